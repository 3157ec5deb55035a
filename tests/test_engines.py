"""Generation engines (common/engine/engines.py) on the tiny model: HF generate and vLLM, base and LoRA."""

import json

import pytest

from common.engine.engines import Generation, make_engine
from common.engine.models import resolve_model
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import tiny
from common.envs.bfcl.prompts import first_prompt

MAX_LEN = 16384


@pytest.fixture(scope="module")
def prompts(tiny_model):
    """A full BFCL turn-0 prompt (~5k tokens, a task of the tiny preset) and two short chat prompts, as token ids."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = next(t for t in bfcl.load_tasks(tiny.PRESET_TASKS).values() if t["ground_truth"][0])
    full = tok(first_prompt(task))["input_ids"]  # bfcl-eval's QwenFCHandler prompt, as the model is trained on
    short = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
             for q in ["List the files in the current directory.", "Post a tweet saying hello."]]
    assert len(full) > 3000
    return [full, *short]


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@pytest.fixture(scope="module")
def hf(tiny_model):
    engine = make_engine("hf", tiny_model, max_model_len=MAX_LEN, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts):
    return hf.generate(prompts, [24, 24, 24], 0.0)


def forward_logprobs(model, prompt, ids, temperature=1.0):
    """log p(ids[t] | prompt + ids[:t]) from one transformers forward pass (logits / temperature)."""
    import torch
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()


def check_contract(gens, limits, stop_ids):
    for g, limit in zip(gens, limits, strict=True):
        assert isinstance(g, Generation)
        assert len(g.ids) == len(g.logprobs) > 0
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert len(g.ids) <= limit
        if g.finish == "stop":
            assert g.ids[-1] in stop_ids and not set(g.ids[:-1]) & set(stop_ids)
        else:
            assert g.finish == "length" and len(g.ids) == limit and not set(g.ids) & set(stop_ids)


# ----------------------------------------------------------------------------- HF


def test_hf_contract(hf, prompts, hf_greedy):
    assert hf.tokenizer.eos_token_id in hf.stop_ids
    check_contract(hf_greedy, [24, 24, 24], hf.stop_ids)
    gens = hf.generate(prompts, [3, 40, 1], 1.0)
    check_contract(gens, [3, 40, 1], hf.stop_ids)
    assert len(gens[0].ids) <= 3 and len(gens[2].ids) == 1


def test_hf_greedy_continues_the_whole_prompt(model, prompts, hf_greedy):
    # Each greedy id is the most likely next token after the whole prompt and the ids before it,
    # by one forward pass of the model (within float noise: a near tie may go either way). A
    # truncated or mis-padded prompt, or ids shifted by one, would continue another text.
    import torch
    for p, g in zip(prompts, hf_greedy, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + g.ids])).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, torch.tensor(g.ids)[:, None]).squeeze(1)
        assert (lp.max(dim=-1).values - chosen).max().item() < 1e-4, g.ids


def test_hf_logprobs_match_forward(hf, model, prompts, hf_greedy):
    for p, g in zip(prompts, hf_greedy, strict=True):
        ref = forward_logprobs(model, p, g.ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < 1e-4
    # sampling: the log-probabilities are those of softmax(logits / temperature)
    for temperature in (1.0, 0.7):
        for p, g in zip(prompts, hf.generate(prompts, [16] * 3, temperature), strict=True):
            ref = forward_logprobs(model, p, g.ids, temperature)
            assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < 1e-4


def test_hf_batch_equals_single(hf, prompts, hf_greedy):
    # left padding must not change greedy outputs; sub-batching by memory budget neither
    for p, g in zip(prompts, hf_greedy, strict=True):
        assert hf.generate([p], [24], 0.0)[0].ids == g.ids
    small = make_engine("hf", hf.base, max_model_len=MAX_LEN, max_batch_tokens=1000)
    assert [g.ids for g in small.generate(prompts, [24] * 3, 0.0)] == [g.ids for g in hf_greedy]


def test_hf_sampling_is_deterministic_per_seed(tiny_model, prompts):
    # The contract: the same seed and sequence of calls give the same ids, and the
    # per-call seed moves on. What a temperature-1 sample of one build is decides nothing
    # here (a warm-started model is peaked: two of its samples often coincide), so the
    # "moves on" half samples at a temperature that flattens any model's distribution,
    # where 20 tokens over a 4k vocabulary coincide with probability ~0.
    short = prompts[1:]
    runs = []
    for _ in range(2):
        engine = make_engine("hf", tiny_model, max_model_len=MAX_LEN, seed=7)
        runs.append([[g.ids for g in engine.generate(short, [20, 20], t)] for t in (1.0, 1.0, 1e4, 1e4)])
        engine.close()
    assert runs[0] == runs[1]
    assert runs[0][2] != runs[0][3]  # the per-call seed moves on
    other = make_engine("hf", tiny_model, max_model_len=MAX_LEN, seed=8)
    assert [g.ids for g in other.generate(short, [20, 20], 1e4)] != runs[0][2]  # and depends on the seed
    other.close()


def test_hf_leaves_global_rng_alone(hf, prompts):
    import torch
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    hf.generate(prompts[1:2], [5], 1.0)
    assert torch.equal(torch.rand(3), expected)


def test_limits_are_checked(hf, tiny_model, prompts):
    assert hf.generate([], [], 0.0) == []
    with pytest.raises(ValueError):
        hf.generate(prompts[:1], [1, 2], 0.0)
    with pytest.raises(ValueError):
        make_engine("nope", tiny_model, max_model_len=MAX_LEN)
    small = make_engine("hf", tiny_model, max_model_len=300)
    with pytest.raises(ValueError):
        small.generate([prompts[1][:1] * 300], [10], 0.0)  # no room left
    # the limit is clamped to the room left in the context
    gens = small.generate([prompts[1][:1] * 297, prompts[1]], [50, 5], 1.0)
    assert len(gens[0].ids) <= 3 and len(gens[1].ids) <= 5
    small.close()


# ----------------------------------------------------------------------------- vLLM


@pytest.fixture
def vllm_engine(tiny_model, tiny_server):
    engine = make_engine("vllm", tiny_model, max_model_len=MAX_LEN, seed=0, servers=[tiny_server])
    yield engine
    engine.close()


def test_vllm_agrees_with_hf(vllm_engine, model, prompts, hf_greedy):
    gens = vllm_engine.generate(prompts, [24, 24, 24], 0.0)
    check_contract(gens, [24, 24, 24], vllm_engine.stop_ids)
    for p, g, h in zip(prompts, gens, hf_greedy, strict=True):
        assert g.ids[:8] == h.ids[:8]
        ref = forward_logprobs(model, p, g.ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < 1e-4


def test_vllm_sampling_logprobs(vllm_engine, model, prompts):
    gens = vllm_engine.generate(prompts, [12, 30, 5], 0.7)
    check_contract(gens, [12, 30, 5], vllm_engine.stop_ids)
    for p, g in zip(prompts, gens, strict=True):
        ref = forward_logprobs(model, p, g.ids, 0.7)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < 1e-4


# ----------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    """A random r=8 all-linear LoRA adapter (B nonzero, so it changes outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
    out = str(tmp_path_factory.mktemp("lora"))
    peft_model.save_pretrained(out)
    with open(f"{out}/adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == tiny_model
    return out


@pytest.fixture(scope="module")
def merged(adapter):
    from peft import AutoPeftModelForCausalLM
    return AutoPeftModelForCausalLM.from_pretrained(adapter).merge_and_unload().eval()


def test_resolve_adapter(adapter, tiny_model):
    base, ad, cfg = resolve_model(adapter)
    assert (base, ad, cfg["r"]) == (tiny_model, adapter, 8)
    assert resolve_model(tiny_model) == (tiny_model, None, None)


def test_hf_lora_changes_output(adapter, merged, prompts, hf_greedy):
    engine = make_engine("hf", adapter, max_model_len=MAX_LEN)
    gens = engine.generate(prompts, [24] * 3, 0.0)
    engine.close()
    check_contract(gens, [24] * 3, engine.stop_ids)
    assert [g.ids for g in gens] != [g.ids for g in hf_greedy]
    for p, g in zip(prompts, gens, strict=True):
        ref = forward_logprobs(merged, p, g.ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < 1e-4


def test_vllm_lora_changes_output(tiny_server, adapter, merged, prompts, hf_greedy):
    from common.engine import serve
    serve.reload([tiny_server], adapter)  # loaded at run time beside the base
    engine = make_engine("vllm", adapter, max_model_len=MAX_LEN, seed=0, servers=[tiny_server])
    try:
        gens = engine.generate(prompts, [24] * 3, 0.0)
    finally:
        engine.close()
    check_contract(gens, [24] * 3, engine.stop_ids)
    assert [g.ids for g in gens] != [g.ids for g in hf_greedy]
    for p, g in zip(prompts, gens, strict=True):
        ref = forward_logprobs(merged, p, g.ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < 1e-3


def test_every_eos_of_the_generation_config_stops(tmp_path, tiny_model):
    """A model whose generation config has two eos ids (Qwen2.5: <|im_end|> and <|endoftext|>):
    both stop a generation, whichever comes first."""
    import shutil

    from transformers import AutoTokenizer
    folder = tmp_path / "two-eos"
    shutil.copytree(tiny_model, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [im_end, eot]}))
    engine = make_engine("hf", str(folder), max_model_len=MAX_LEN)
    try:
        assert set(engine.stop_ids) == {im_end, eot}
        for stop in (im_end, eot):
            g = engine._finish([5, 6, stop, 7], [-0.1] * 4, 10)
            assert g.ids == [5, 6, stop] and g.finish == "stop"
    finally:
        engine.close()


def test_tokenizer_is_autotokenizers_without_its_imports(tiny_model, tmp_path):
    """load_tokenizer picks AutoTokenizer's class (the model type's own) without importing
    transformers' auto module; a folder naming a generic class goes through AutoTokenizer."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from common.engine.models import load_tokenizer
    auto, ours = AutoTokenizer.from_pretrained(tiny_model), load_tokenizer(tiny_model)
    assert type(ours) is type(auto) and type(ours).__name__ == "Qwen2Tokenizer"
    text = first_prompt(next(t for t in bfcl.load_tasks(tiny.PRESET_TASKS).values() if t["ground_truth"][0]))
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.eos_token_id == auto.eos_token_id and ours.chat_template == auto.chat_template
    probe = "import sys; from common.engine.models import load_tokenizer; load_tokenizer(sys.argv[1]); " \
            "print(sorted(m for m in ('torch', 'sklearn', 'transformers.models.auto.tokenization_auto') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe, tiny_model], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

    generic = tmp_path / "generic"
    shutil.copytree(tiny_model, generic, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((generic / "tokenizer_config.json").read_text())
    (generic / "tokenizer_config.json").write_text(json.dumps(cfg | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert type(load_tokenizer(str(generic))) is type(AutoTokenizer.from_pretrained(str(generic)))
