"""Per-trajectory scheduling on vLLM's server (common/envs/bfcl/play.py, schedule "async"), with the
tiny model and real training tasks: same records as lock-step at temperature 0, and a
failed request fails the stage and leaves the engine clean.
"""

import math
import os
import subprocess
import sys

import pytest

from common.engine.engines import make_engine
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Short prompts of different categories (CPU cost of a step is the prefill); their
# trajectories take different numbers of steps and tokens, so async really interleaves.
TASK_IDS = ["multi_turn_base_105", "multi_turn_miss_func_146", "multi_turn_miss_param_100",
            "multi_turn_long_context_100"]


@pytest.fixture(scope="module")
def tasks():
    by_id = bfcl.load_tasks(os.path.join(ROOT, "data", "train.jsonl"))
    return [by_id[i] for i in TASK_IDS]


def test_a_failing_trajectory_fails_the_stage_and_the_engine_keeps_serving(vllm_engine, tasks, tiny_model):
    """A request the server refuses (a prompt beyond its context, sent by an engine told a larger
    one) fails with the server's answer; the other requests are dropped and the engine serves on."""
    from common.engine.models import model_context
    served = model_context(tiny_model)  # the session server's context
    big = [5] * (served + 1000)
    vllm_engine.max_model_len = 2 * served  # what a misconfigured stage would believe
    try:
        vllm_engine.submit("ok", [5, 6, 7], 4, 1.0)
        vllm_engine.submit("big", big, 4, 1.0)
        with pytest.raises(Exception, match="answered 400"):
            while vllm_engine.pending:
                vllm_engine.poll()
    finally:
        vllm_engine.max_model_len = 16384
        vllm_engine.abort()
    assert not vllm_engine.pending
    # The engine is left clean and usable.
    (gen,) = vllm_engine.generate([[1, 2, 3]], [2], 0.0)
    assert len(gen.ids) >= 1


@pytest.fixture
def vllm_engine(tiny_model, tiny_server):
    engine = make_engine("vllm", tiny_model, max_model_len=16384, seed=0, servers=[tiny_server])
    yield engine
    engine.close()


def _without_wall_time(rec):
    return {**rec, "stats": {k: v for k, v in rec["stats"].items() if k != "seconds"}, "tokens": None}


def test_async_gives_the_lockstep_records_at_temperature_0(vllm_engine, tasks):
    settings = dict(temperature=0.0, max_new_tokens=24, max_steps_per_turn=2)
    lock, t_lock = play.play(tasks, 2, vllm_engine, play.PlaySpec(schedule="lockstep", **settings), progress=False)
    asyn, t_async = play.play(tasks, 2, vllm_engine, play.PlaySpec(schedule="async", **settings), progress=False)
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
        play.play(tasks[:1], 1, engine, play.PlaySpec(schedule="async"), progress=False)
    out = tmp_path / "r.jsonl"
    res = subprocess.run([sys.executable, "rollout.py", "--model", tiny_model, "--tasks", "data/train.jsonl",
                          "--engine", "hf", "--schedule", "async", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and "--schedule async needs --engine vllm" in res.stderr
    assert not out.exists()
