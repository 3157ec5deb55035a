"""The engine through vLLM's server vs vLLM in this process, and an in-place reload vs a cold start.

    .venv/bin/python bench/engine_bench.py [--n 4] [--repeats 3] [--max-new-tokens 96]

Workload: the tiny preset's model and its 8 training tasks played whole (every turn), 4 samples
each, at temperature 0 so that both engines do exactly the same work (their records are equal:
the bench checks it). Each engine first plays the work once untimed (a fresh engine's first
requests cost seconds more; reported apart); then runs are interleaved (in-process, server,
in-process, ...), each on an emptied prefix cache as a round's rollouts find it after the
policy's reload (a repeat of the same greedy work would otherwise be served from the cache), and summed:
1. trajectories/s through the server (`ServerEngine`, per-trajectory scheduling, as every stage
   plays) over vLLM's in-process `LLM` stepped by the same loop (the engine the stages used
   before the server; kept here only as the yardstick); target >= 0.9;
2. seconds of an in-place reload (`common.serve.reload`, a full model) vs a cold start of the
   same server (`common.serve.start` until healthy).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import bfcl, play, serve  # noqa: E402
from common.engines import Engine, make_engine  # noqa: E402
from common.models import resolve_model  # noqa: E402
from common.tiny import PRESET_TASKS, build_cached  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, default=4)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--max-steps-per-turn", type=int, default=3)
args = parser.parse_args()


class InProcess(Engine):
    """vLLM's `LLM` in this process, stepped request by request (the stages' engine before the server)."""

    def __init__(self, model_dir, max_model_len):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        server = make_engine("hf", model_dir, max_model_len=max_model_len)  # tokenizer and stop ids, as ours
        self.tokenizer, self.stop_ids, self.max_model_len = server.tokenizer, server.stop_ids, max_model_len
        server.close()
        base, _, _ = resolve_model(model_dir)
        self.llm = LLM(model=base, max_model_len=max_model_len, seed=0, dtype="float32", enforce_eager=True,
                       logprobs_mode="processed_logprobs", kv_cache_memory_bytes=1 << 30)
        self.pending, self.n = {}, 0

    def submit(self, key, prompt, max_new_tokens, sampling):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from common.engines import sampling_params
        (limit,) = self._limits([prompt], [max_new_tokens])
        self.n += 1
        self.llm.llm_engine.add_request(f"r{self.n}", TokensPrompt(prompt_token_ids=list(prompt)),
                                        SamplingParams(**sampling_params(sampling), max_tokens=limit, logprobs=0,
                                                       stop_token_ids=list(self.stop_ids), detokenize=False))
        self.pending[f"r{self.n}"] = (key, limit)

    def poll(self):
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                key, limit = self.pending.pop(out.request_id)
                o = out.outputs[0]
                done.append((key, self._finish(list(o.token_ids), [o.logprobs[t][i].logprob
                                                                   for t, i in enumerate(o.token_ids)], limit)))
        return done

    def abort(self):
        self.pending.clear()


root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
train = bfcl.load_tasks(os.path.join(root, "data", "train.jsonl"))
tasks = [train[i.removesuffix("_1turn")] for i in bfcl.load_tasks(PRESET_TASKS)]
model = build_cached()
spec = play.PlaySpec(temperature=0.0, max_new_tokens=args.max_new_tokens, max_steps_per_turn=args.max_steps_per_turn,
                     schedule="async")
log = tempfile.mkdtemp(prefix="engine-bench-")
print(f"engine bench, {time.strftime('%Y-%m-%d')}: tiny model, {len(tasks)} tasks x {args.n}, temperature 0, "
      f"{args.repeats} interleaved runs; load average {os.getloadavg()[0]:.1f}")

t0 = time.perf_counter()
state = serve.start(model, os.path.join(log, "server.log"), max_model_len=16384, seed=0)
cold = time.perf_counter() - t0
try:
    server = make_engine("vllm", model, max_model_len=16384, servers=[state["url"]])
    local = InProcess(model, 16384)
    engines = (("in-process", local), ("server", server))
    for name, engine in engines:
        t = time.perf_counter()
        play.play(tasks, args.n, engine, spec, progress=False)
        print(f"  first run on a fresh engine, {name}: {time.perf_counter() - t:.1f} s (not counted)")
    sums = {"in-process": [0, 0.0], "server": [0, 0.0]}
    reference = None
    for _ in range(args.repeats):
        for name, engine in engines:
            local.llm.reset_prefix_cache()
            serve.request(state["url"], "/reset_prefix_cache", {})
            t = time.perf_counter()
            recs, _ = play.play(tasks, args.n, engine, spec, progress=False)
            sums[name][0] += len(recs)
            sums[name][1] += time.perf_counter() - t
            ids = [r["tokens"]["ids"] for r in recs]
            assert reference is None or ids == reference, "the engines' greedy records differ"
            reference = ids
    for name, (n, s) in sums.items():
        print(f"  {name:10s} {n / s:6.2f} trajectories/s ({n} in {s:.1f} s)")
    ratio = (sums["server"][0] / sums["server"][1]) / (sums["in-process"][0] / sums["in-process"][1])
    print(f"  server / in-process trajectories/s: {ratio:.2f} (target >= 0.9); records equal")

    other = tempfile.mkdtemp(prefix="engine-bench-policy-")
    shutil.copytree(model, other, dirs_exist_ok=True)
    t = time.perf_counter()
    serve.load(state["url"], other)  # the reload itself, whatever the model's embeddings
    reload_s = time.perf_counter() - t
    print(f"  in-place reload {reload_s:.2f} s vs cold start {cold:.1f} s of the same server "
          f"({cold / reload_s:.0f}x)")
finally:
    serve.stop_group(state["pid"])
    shutil.rmtree(log, ignore_errors=True)
