"""Per-trajectory scheduling on the vLLM engine (common/play.py, schedule "async"), with the
tiny model and real training tasks: same records as lock-step at temperature 0, and a
failure inside one trajectory fails the stage and leaves nothing running in the engine.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from common import bfcl, play
from common.engines import make_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Short prompts of different categories (CPU cost of a step is the prefill); their
# trajectories take different numbers of steps and tokens, so async really interleaves.
TASK_IDS = ["multi_turn_base_105", "multi_turn_miss_func_146", "multi_turn_miss_param_100",
            "multi_turn_long_context_100"]


@pytest.fixture(scope="module")
def tasks():
    by_id = bfcl.load_tasks(os.path.join(ROOT, "data", "train.jsonl"))
    return [by_id[i] for i in TASK_IDS]


def test_engine_error_in_one_trajectory_fails_the_stage_and_aborts_the_rest(tiny_model, tasks):
    tok = make_engine("hf", tiny_model, max_model_len=16384).tokenizer
    longest = 0
    for task in tasks:
        t = play.Trajectory(task, 0, None, tok, "json")
        longest = max(longest, len(t.prompt_ids))
        t.env.close()
    # The engine's context holds every first prompt plus 4 tokens, the loop believes in 16k:
    # each trajectory's second request overflows the engine, a real per-request error.
    threads = torch.get_num_threads()
    engine = make_engine("vllm", tiny_model, max_model_len=longest + 4, seed=0)
    try:
        if "OMP_NUM_THREADS" not in os.environ and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" \
                and not torch.cuda.is_available():
            assert torch.get_num_threads() == 1  # the in-process engine core's one thread (engines.py)
        with pytest.raises(play.TrajectoryFailed, match=r"task multi_turn_\w+ sample \d: engine request failed"):
            play.play(tasks, 2, engine, temperature=1.0, max_new_tokens=4, max_model_len=16384,
                      progress=False, schedule="async")
        assert not engine.pending
        assert not engine.llm.llm_engine.has_unfinished_requests()
        # The engine is left clean and usable.
        (gen,) = engine.generate([[1, 2, 3]], [2], 0.0)
        assert len(gen.ids) >= 1
    finally:
        engine.close()
    assert torch.get_num_threads() == threads  # the process's other work has its threads back


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    engine = make_engine("vllm", tiny_model, max_model_len=16384, seed=0)
    yield engine
    engine.close()


def _without_wall_time(rec):
    return {**rec, "stats": {k: v for k, v in rec["stats"].items() if k != "seconds"}, "tokens": None}


def test_async_gives_the_lockstep_records_at_temperature_0(vllm_engine, tasks):
    settings = dict(temperature=0.0, max_new_tokens=24, max_steps_per_turn=2, progress=False)
    lock, t_lock = play.play(tasks, 2, vllm_engine, schedule="lockstep", **settings)
    asyn, t_async = play.play(tasks, 2, vllm_engine, schedule="async", **settings)
    assert [(r["task_id"], r["sample_index"]) for r in asyn] == [(r["task_id"], r["sample_index"]) for r in lock]
    for a, b in zip(asyn, lock, strict=True):
        # transcript, calls, results, stop reasons, counts: equal
        assert _without_wall_time(a) == _without_wall_time(b)
        ta, tb = a["tokens"], b["tokens"]
        assert ta["prompt_ids"] == tb["prompt_ids"] and ta["ids"] == tb["ids"] and ta["mask"] == tb["mask"]
        # log-probs: batch composition differs between schedules; float sums may too
        for x, y in zip(ta["logprobs"], tb["logprobs"], strict=True):
            assert (x is None) == (y is None)
            assert x is None or math.isclose(x, y, abs_tol=1e-4)
    # several steps per trajectory, so async had requests to resubmit
    assert sum(len(turn["steps"]) for r in asyn for turn in r["turns"]) > len(asyn)
    # both schedules count the prompt tokens they sent, and the cache served some of them
    assert t_async["prompt_tokens"] > 0 and 0 < t_async["cached_tokens"] <= t_async["prompt_tokens"]
    assert t_lock["prompt_tokens"] == t_async["prompt_tokens"]


def test_async_is_refused_on_the_hf_engine(tiny_model, tasks, tmp_path):
    engine = make_engine("hf", tiny_model, max_model_len=16384)
    with pytest.raises(ValueError, match="lock-step only"):
        play.play(tasks[:1], 1, engine, schedule="async", progress=False)
    out = tmp_path / "r.jsonl"
    res = subprocess.run([sys.executable, "rollout.py", "--model", tiny_model, "--tasks", "data/train.jsonl",
                          "--engine", "hf", "--schedule", "async", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and "--schedule async needs --engine vllm" in res.stderr
    assert not out.exists()


def test_data_parallel_replicas_pin_trajectories_and_give_the_same_records(vllm_engine, tiny_model, tasks):
    """Two replicas on CPU (in one process here; GPU placement is not exercised)."""
    settings = dict(temperature=0.0, max_new_tokens=24, max_steps_per_turn=2, progress=False)
    single, _ = play.play(tasks, 1, vllm_engine, schedule="async", **settings)
    engine = make_engine("vllm", tiny_model, max_model_len=16384, seed=0, data_parallel_size=2)
    served = {}
    submit = engine.submit

    def watch(key, *a):  # which replica each request of a trajectory went to
        submit(key, *a)
        served.setdefault(key, set()).add(engine.pins[key])

    engine.submit = watch
    try:
        with pytest.raises(ValueError, match="async"):
            engine.generate([[1, 2, 3]], [2], 0.0)
        recs, timing = play.play(tasks, 1, engine, schedule="async", **settings)
        assert all(len(r) == 1 for r in served.values())  # pinned for life
        assert sorted(min(r) for r in served.values()) == [0, 0, 1, 1]  # balanced
        assert not engine.pins and not engine.pending
        assert all(e.prompt_tokens > 0 for e in engine.replicas)
        assert timing["cached_tokens"] > 0
    finally:
        engine.close()
    for a, b in zip(recs, single, strict=True):
        assert _without_wall_time(a) == _without_wall_time(b)
        assert a["tokens"]["ids"] == b["tokens"]["ids"] and a["tokens"]["mask"] == b["tokens"]["mask"]
