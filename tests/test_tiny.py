"""The tiny offline model: tokenizer, chat template, model folder (common/run/tiny.py), and its warm start on
BFCL and τ² (common/envs/bfcl/tiny.py, common/envs/tau2/tiny.py)."""

import json
import os

import pytest

from common.engine import calls as C
from common.engine.chat import to_chat_tools
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import tiny as bfcl_tiny
from common.envs.tau2 import Tau2Env
from common.envs.tau2 import tiny as tau2_tiny
from common.run import tiny

SAMPLES = [
    "Move 'final_report.pdf' within document directory to 'temp' directory.",
    "héllo  wörld\n\n  tabs\t\tend   \n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
    '{"name": "cd", "arguments": {"folder": "doc"}}\n</tool_call><|im_end|><|endoftext|>',
    "<tool_response>\n{\"result\": 42.5}\n</tool_response>Ünïcode → 日本語 🙂 don't I'll",
]

TOOLS = [
    {"name": "cd", "description": "Change directory.",
     "parameters": {"type": "dict", "properties": {"folder": {"type": "string", "description": "Folder."}},
                    "required": ["folder"]}},
    {"name": "add", "description": "Add numbers.",
     "parameters": {"type": "dict", "properties": {
         "a": {"type": "float", "description": "x"},
         "pair": {"type": "tuple", "items": {"type": "any"}},
         "opts": {"type": "dict", "properties": {"k": {"type": "integer"}}},
         "v": {"type": "any"}}, "required": ["a"]},
     "response": {"type": "dict", "properties": {"sum": {"type": "float"}}}},
]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def train_tasks():
    return list(bfcl.load_tasks(bfcl_tiny.DEFAULT_TASKS).values())


# ----------------------------------------------------------------------------- tokenizer


def test_autotokenizer_matches_trained_bpe(tiny_model, tok):
    from tokenizers import Tokenizer
    bpe = Tokenizer.from_file(os.path.join(tiny_model, "bpe_tokenizer.json"))
    assert type(tok).__name__ == "Qwen2Tokenizer"
    for text in SAMPLES:
        assert tok(text)["input_ids"] == bpe.encode(text).ids, text
    # a whole rendered BFCL prompt too
    ids = tok.apply_chat_template([{"role": "user", "content": SAMPLES[0]}], tools=to_chat_tools(TOOLS),
                                  tokenize=False)
    assert tok(ids)["input_ids"] == bpe.encode(ids).ids


def test_special_and_added_tokens(tok):
    for t in tiny.SPECIAL_TOKENS + tiny.ADDED_TOKENS:
        assert len(tok(t)["input_ids"]) == 1, t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.bos_token is None
    assert len(tok) == 4096
    # tool-call markers survive skip_special_tokens (the parser needs them); chat markers do not
    ids = tok("<tool_call>\n{}\n</tool_call><|im_end|>")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"


def test_round_trip(tok):
    for text in SAMPLES:  # NFC-normalised already, so decoding gives the text back
        assert tok.decode(tok(text)["input_ids"]) == text


def test_bpe_training_is_deterministic():
    texts = [f"call number {i}: " + json.dumps({"name": f"f{i % 7}", "arguments": {"x": i}}) for i in range(300)]
    a, b = tiny.train_bpe(texts, 400), tiny.train_bpe(texts, 400)
    assert a.to_str() == b.to_str()


# ----------------------------------------------------------------------------- chat template


def test_to_chat_tools_maps_bfcl_types():
    out = to_chat_tools(TOOLS)
    assert [t["type"] for t in out] == ["function", "function"]
    f = out[1]["function"]
    assert set(f) == {"name", "description", "parameters"}  # no "response"
    p = f["parameters"]
    assert p["type"] == "object" and p["required"] == ["a"]
    assert p["properties"]["a"]["type"] == "number"
    assert p["properties"]["pair"]["type"] == "array" and p["properties"]["pair"]["items"]["type"] == "string"
    assert p["properties"]["opts"]["type"] == "object"
    assert p["properties"]["opts"]["properties"]["k"]["type"] == "integer"
    assert p["properties"]["v"]["type"] == "string"
    assert TOOLS[1]["parameters"]["type"] == "dict"  # input untouched


def _conversation():
    return [
        {"role": "user", "content": "Go to doc and add 1."},
        {"role": "assistant", "content": C.format_calls([{"name": "cd", "arguments": {"folder": "doc"}},
                                                         {"name": "add", "arguments": {"a": 1}}], "json")},
        {"role": "tool", "content": '{"current_working_directory": "doc"}'},
        {"role": "tool", "content": '{"sum": 1}'},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks."},
    ]


def test_chat_template_renders_like_qwen(tok):
    tools = to_chat_tools(TOOLS)
    text = tok.apply_chat_template(_conversation(), tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0], ensure_ascii=False) + "\n" + json.dumps(tools[1], ensure_ascii=False) \
        + "\n</tools>" in text
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\nGo to doc and add 1.<|im_end|>\n") in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "cd", "arguments": {"folder": "doc"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n') in text
    # consecutive tool messages: one user block
    assert ('<|im_start|>user\n<tool_response>\n{"current_working_directory": "doc"}\n</tool_response>\n'
            '<tool_response>\n{"sum": 1}\n</tool_response><|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>\n') in text
    assert text.count("<|im_start|>user") == 3
    assert text.endswith("<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_system_and_no_tools(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    text = tok.apply_chat_template(msgs, tools=to_chat_tools(TOOLS[:1]), tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # a single tool message at the end still closes its block
    text = tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], tokenize=False)
    assert text.endswith("<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n")


def test_chat_template_tokenize_equals_tokenizer_of_text(tok):
    tools = to_chat_tools(TOOLS)
    text = tok.apply_chat_template(_conversation(), tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(_conversation(), tools=tools, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    assert ids == tok(text)["input_ids"]


# ----------------------------------------------------------------------------- model folder and data


def test_model_folder_loads(tiny_model, tok):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(tiny_model)
    assert cfg.model_type == "qwen2" and not cfg.tie_word_embeddings  # its own output layer: vLLM reloads it in place
    assert cfg.max_position_embeddings >= 16384 and cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.dtype == torch.float32
    # positions far beyond the warm-start windows work (a ~16.4k-token prompt)
    ids = torch.randint(10, len(tok), (1, 16_400))
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=1).logits
    assert torch.isfinite(logits).all()
    info = json.load(open(os.path.join(tiny_model, "build_info.json")))
    assert info["args"]["max_positions"] >= 16384


def test_conversation_uses_real_tool_results(train_tasks):
    task = train_tasks[0]
    msgs = bfcl_tiny.conversation(task)
    assert msgs[0] == task["questions"][0][0]
    calls, err = C.parse(msgs[1]["content"], "json")
    assert err is None and calls == bfcl.ground_truth_calls(task, 0)
    tool_msgs = [m for m in msgs[2:2 + len(calls)]]
    assert [m["role"] for m in tool_msgs] == ["tool"] * len(calls)
    assert "current_working_directory" in tool_msgs[0]["content"]  # cd's real result
    assert msgs[2 + len(calls)] == {"role": "assistant", "content": bfcl_tiny.DONE_ANSWER}
    # a turn with empty ground truth gets a plain answer and no calls
    empty = next(t for t in train_tasks if not t["ground_truth"][0])
    m = bfcl_tiny.conversation(empty)
    assert m[1]["role"] == "assistant" and "<tool_call>" not in m[1]["content"]


def test_examples_cover_assistant_tokens_only():
    ids = list(range(100))
    spans = [(40, 50), (70, 75)]
    ex = tiny.make_examples(ids, spans, [True, False], context=16)
    (x0, p0, f0), (x1, p1, f1) = ex
    assert x0 == ids[24:50] and f0 and not f1
    assert [x0[p + 1] for p in p0] == list(range(40, 50))
    assert [x1[p + 1] for p in p1] == list(range(70, 75))


def test_build_cached_reuses(tiny_model, capsys):
    assert tiny.build_cached() == tiny_model
    # the fixture's model is the seed SEAL_TINY_SEED asks for (default: the build's own)
    seed = int(os.environ.get("SEAL_TINY_SEED", tiny.DEFAULTS["seed"]))
    assert os.path.basename(tiny_model) == "tiny-" + tiny.build_key(seed=seed)
    tiny.main([])  # the command line without --measure: the cached folder, no measurement
    assert capsys.readouterr().out.strip() == tiny_model
    info = json.load(open(os.path.join(tiny_model, "build_info.json")))
    assert info["args"]["seed"] == seed and info["n_examples"] > 0 and info["timings"]["train_s"] > 0


# ----------------------------------------------------------------------------- warm start


def test_near_misses_fail_where_the_ground_truth_passes():
    # The warm start teaches each preset call task its ground truth and a near miss; GRPO's
    # groups are mixed only if the official checker tells the two apart.
    for task in bfcl.load_tasks(bfcl_tiny.PRESET_TASKS).values():
        right, miss = bfcl_tiny.conversation(task), bfcl_tiny.conversation(task, miss=True)
        gt = bfcl.ground_truth_calls(task, 0)
        if not gt:
            assert miss is None  # an abstention has no near miss
            continue
        calls, err = C.parse(miss[1]["content"], "json")
        assert err is None and len(calls) == len(gt) and calls[:-1] == gt[:-1], task["id"]
        changed = [k for k in gt[-1]["arguments"] if calls[-1]["arguments"][k] != gt[-1]["arguments"][k]]
        assert len(changed) == 1 and calls[-1]["arguments"][changed[0]].endswith(tiny.NEAR_MISS_SUFFIX)
        assert [m["role"] for m in miss] == [m["role"] for m in right]
        assert bfcl.official_verdict(task, [[[C.render(c) for c in gt]]])["valid"], task["id"]
        assert not bfcl.official_verdict(task, [[[C.render(c) for c in calls]]])["valid"], task["id"]
    assert tiny.near_miss([{"name": "f", "arguments": {"n": 1}}]) is None


def test_tau2_build_learns_the_episodes_its_loop_plays(tok):
    """A τ² build (loop.sh tiny --set ENV=tau2:DOMAIN) learns the oracle's episodes of the tasks its
    loop plays, against the same scripted user: τ²'s evaluator scores them 1, and their near misses
    (the last write's string argument suffixed, or the closing message without what the user must be
    told) 0, so sampled groups can be mixed. Its examples train only on what the rollouts' own
    policy generated: the script's messages and their closing <|im_end|>, nothing the user or a tool said."""
    warm = tau2_tiny.WarmStart("tau2:airline", {"miss_share": 0.4, "context": 256})
    assert len(warm.tasks) == Tau2Env.TINY_TASKS
    misses = {}
    for task in warm.tasks:
        assert tau2_tiny.tau2_play(warm.env, task, warm.script(task, False))[0]["reward"] == 1.0, task.id
        if warm.script(task, True) is not None:
            row, _ = tau2_tiny.tau2_play(warm.env, task, warm.script(task, True))
            misses[task.id] = row["reward"]
            sent = [c for m in row["transcript"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
            if any(c["arguments"] != a.arguments for c, a in zip(sent, task.evaluation_criteria.actions, strict=False)):
                assert any(str(v).endswith(tiny.NEAR_MISS_SUFFIX) for c in sent for v in c["arguments"].values())
    # airline's first tasks: 7 and 9 write (cancel_reservation), 3 only reads and must tell a figure
    assert misses == {"3": 0.0, "7": 0.0, "9": 0.0}
    warm.tasks = [task for task in warm.tasks if task.id == "9"]
    examples, weights = warm.examples(tok, None)
    script, texts = warm.script(warm.tasks[0], False), []
    while not script.told:
        texts.append(script.agent_text(None, None))
    targets = [tok.decode([int(x[p + 1]) for p in pos]) for x, pos, _ in examples]
    assert targets[:len(texts)] == [t + tiny.EOS for t in texts]  # plain view, the right episode first
    assert len(examples) == 2 * (len(texts) + len(texts)) and sorted(set(weights)) == [0.4, 0.6]
    assert all(len(x) <= 256 + tiny.MAX_TARGET for x, _, _ in examples)


def test_tau2_build_is_a_model_folder(tmp_path, monkeypatch):
    """A τ² build (here a user's own domain, two warm-start steps) is a model folder as the BFCL build
    is: transformers loads it, its tokenizer is the BPE it trained on the domain's texts, and
    build_info names the environment and the split it learnt; its cache key follows the domain."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    monkeypatch.setenv("SEAL_TAU2_DOMAINS", os.path.join(tiny.REPO, "docs", "examples", "shop_domain.py"))
    info = tiny.build(str(tmp_path / "m"), env="tau2:shop", steps=2)
    assert info["tasks"] == "tau2:shop:train" and info["args"]["env"] == "tau2:shop" and info["preset_tasks"] is None
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    bpe = Tokenizer.from_file(str(tmp_path / "m" / "bpe_tokenizer.json"))
    text = "<|im_start|>user\nI want to order 2 mugs (item i1).<|im_end|>\n"
    assert tok(text)["input_ids"] == bpe.encode(text).ids
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.sliding_window == tiny.DEFAULTS["sliding_window"]
    key = tiny.build_key(env="tau2:shop")
    assert key != tiny.build_key()  # its own cache folder, rebuilt when the domain changes
    from tau2.environment.environment import Environment
    monkeypatch.setattr(Environment, "get_policy", lambda self: "Sell only teapots.")
    assert tiny.build_key(env="tau2:shop") != key
