"""The memory plan (common/memplan.py): its terms against memory measured on CPU at small shapes,
the presets' architecture files, and loop.sh's --plan and its refusals."""

import json
import os
import re
import subprocess

import pytest
import torch

from common import memplan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET_MODELS = ["Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Team-ACE/ToolACE-2-Llama-3.1-8B"]
# small, but with activations and the log-prob chunk well above allocator noise and parameters
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=True)
TOKENS = 512


@pytest.mark.parametrize("model", PRESET_MODELS)
def test_preset_architecture_files_hold_their_parameter_count(model):
    """The shipped numbers give the parameter count the model card states (read_config checks it)."""
    arch = memplan.load_arch(model)
    assert arch.params == json.load(open(memplan.arch_path(model)))["parameters"]


class Memory:
    """Bytes held by torch's CPU allocator over time, from the profiler's allocation events:
    exact accounting of tensor memory, unlike RSS. mark(name) notes the level at a point."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def mark(self, name):
        # a marker allocation of an odd size, found again in the event stream
        self.markers = getattr(self, "markers", {}) | {name: 1_000_003 + len(getattr(self, "markers", {}))}
        torch.empty(self.markers[name], dtype=torch.uint8)

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        events = sorted((e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        sizes = {v: k for k, v in getattr(self, "markers", {}).items()}
        self.level, self.peak_after, cur, peaks = {}, {}, 0, []
        for e in events:
            if e.nbytes() in sizes and sizes[e.nbytes()] not in self.level:
                self.level[sizes[e.nbytes()]] = cur
                peaks.append((sizes[e.nbytes()], cur))
                continue
            if -e.nbytes() in sizes:
                continue
            cur += e.nbytes()
            for name, _ in peaks:
                self.peak_after[name] = max(self.peak_after.get(name, 0), cur)
        self.peak = max(self.peak_after.values(), default=0)


def one_step(checkpointing):
    """One train_grpo-style update of a random Qwen2 on CPU (float32, Accelerate, the GRPO loss
    of common/grpo.py, AdamW), measured on the second step (the first creates AdamW's state)."""
    from accelerate import Accelerator
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.grpo import TrainingSequence, accumulate_gradients

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, SMALL["vocab_size"], (TOKENS,)).tolist()
    traj = TrainingSequence("t", 0, ids[:1], ids[1:], [1] * (TOKENS - 1), [None] * (TOKENS - 1), 1.0, 1.0, 1.0)
    traj.old_logprobs = traj.ref_logprobs = torch.zeros(TOKENS - 1)
    model.train()
    mem = None
    hooks = [model.lm_head.register_forward_pre_hook(lambda *_: mem and mem.mark("trunk")),
             model.model.norm.register_full_backward_pre_hook(lambda *_: mem and mem.mark("head done"))]
    for step in range(2):
        if step == 1:
            mem = Memory().__enter__()
            mem.mark("start")
        accumulate_gradients(model, accelerator, [[traj]], TOKENS - 1, kl_coef=0.001)
        grads = sum(p.grad.nbytes for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mem.__exit__(None, None, None)
    for h in hooks:
        h.remove()
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    return model, mem, grads, state


def near(measured, planned, tol=0.15):
    return abs(planned - measured) <= tol * measured


def test_plan_terms_match_memory_measured_on_cpu():
    """Each term the plan counts for one update, against the same model measured on CPU: weights,
    gradients and AdamW state; activations kept for backward with and without gradient
    checkpointing; the log-prob chunk; the layer recomputed in backward. Within 15 %."""
    arch = memplan.Arch(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=176, vocab=2048,
                        tied=True, bias=True, max_pos=4096)
    results = {}
    for ckpt in (False, True):
        model, mem, grads, state = one_step(ckpt)
        plan = memplan.train_plan(arch, 1, False, TOKENS, ckpt, gpu_mem=2**40, on_gpu=False, chunk=TOKENS)
        terms = {name.split(" (")[0].split(",")[0]: b for name, b, _ in plan.terms}
        n_params = sum(p.numel() for p in model.parameters())
        assert arch.params == n_params
        assert terms["weights"] == 4 * n_params == sum(p.nbytes for p in model.parameters())
        assert near(grads, terms["gradients"]) and near(state, terms["AdamW moments"])
        start = mem.level["start"]
        trunk = mem.level["trunk"] - start  # what forward keeps until the output layer
        # from the output layer to the end of its backward; the output layer's (tied) gradient
        # is the gradients term's
        head = mem.peak_after["trunk"] - mem.level["trunk"] - 4 * arch.vocab * arch.hidden
        results[ckpt] = dict(trunk=(trunk, terms["activations"]), chunk=(head, terms["one log-prob chunk"]))
        if ckpt:
            # after the head's backward: a layer recomputed, less its weights' gradients (the gradients term's)
            layer = mem.peak_after["head done"] - mem.level["head done"] - 4 * arch.layer_params
            results[ckpt]["recompute"] = (layer, terms["one layer recomputed in backward"])
    for ckpt, res in results.items():
        for name, (measured, planned) in res.items():
            assert near(measured, planned), (ckpt, name, measured, planned, results)


def loop(*args, env=None, timeout=120):
    return subprocess.run(["bash", "loop.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.parametrize("preset", ["qwen3b", "qwen7b", "toolace8b"])
def test_every_gpu_preset_fits_its_gpus_and_plans_without_a_download(preset, tmp_path):
    res = loop(preset, "--plan", env={"HF_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "rollout server" in out and "contexts of 16384" in out and "reference pass" in out
    train = out.split("train stage", 1)[1]
    sizes = [float(m[1]) for m in re.finditer(r"^ +([\d.]+) GiB  (?!peak)", train, re.M)]
    assert len(sizes) >= 7 and sizes == sorted(sizes, reverse=True)  # largest term first
    for term in ("AdamW moments", "weights (fp32, 1/4)", "gradients (fp32, 1/4)", "checkpointed", "log-prob chunk",
                 "FSDP all-gathered", "CUDA context"):
        assert term in train
    assert out.count(": fits") == 3 and "DOES NOT FIT" not in out
    assert not os.listdir(tmp_path)  # nothing fetched into HF_HOME


def test_a_setting_that_cannot_fit_is_refused_naming_the_variable(tmp_path):
    res = loop("qwen7b", "--plan", "--set", "EXTRA_TRAIN=")
    assert res.returncode == 3 and "DOES NOT FIT" in res.stdout
    assert "add --gradient-checkpointing to EXTRA_TRAIN" in res.stderr
    # a run stops before round 0, before any check of the machine, and writes nothing
    res = loop("qwen7b", "--set", "MICRO_TOKENS=262144", "--runs", str(tmp_path / "runs"), env={"HF_HOME": str(tmp_path)})
    assert res.returncode == 2 and "lower MICRO_TOKENS to" in res.stderr and "stopped by the memory plan" in res.stderr
    assert not os.listdir(tmp_path)
