"""The learning direction, on real rollouts of the tiny model: one train_grpo.py round raises the
log-probability of the rewarded trajectories and lowers the others', measured with the policy.

The batch: per task, real temperature-1 samples of the policy (whatever they score on this
build) plus two trajectories played by a teacher through the same protocol, whose tokens are
scored by the policy itself: the ground-truth calls (reward 1 by the official checker) and a
plain answer without calls (reward 0). So every group has mixed rewards on every machine, and
the real samples take part with their own rewards and advantages.
"""

import json
import os

import pytest
from helpers import Teacher, in_process, seq_logprob

from common.engine import calls as C
from common.engine.engines import make_engine
from common.envs.bfcl import diagnose as bfcl_diagnose
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play, tiny
from common.jsonl import write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = 3  # real samples per task
MAX_NEW, MAX_STEPS = 96, 3  # the tiny preset's


@pytest.fixture
def batch(tiny_model, tiny_server, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    tasks = list(bfcl.load_tasks(tiny.PRESET_TASKS).values())
    tasks = [t for t in tasks if t["ground_truth"][0]][:2]  # two tasks whose turn needs calls
    engine = make_engine("vllm", tiny_model, max_model_len=16384, servers=[tiny_server])
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    spec = play.PlaySpec(temperature=1.0, max_steps_per_turn=MAX_STEPS, max_new_tokens=MAX_NEW)
    real, _ = play.play(tasks, SAMPLES, engine, spec, progress=False)
    engine.close()
    records = []
    for task in tasks:
        gt = C.format_calls(bfcl.ground_truth_calls(task, 0), "json")
        right = Teacher(model, engine.tokenizer, lambda tail, gt=gt: tiny.DONE_ANSWER if "</tool_response>" in tail else gt)
        wrong = Teacher(model, engine.tokenizer, lambda tail: "I am not able to do that.")
        teach = [play.play([task], 1, t, spec, progress=False)[0][0] for t in (right, wrong)]
        group = [r for r in real if r["task_id"] == task["id"]] + teach
        for k, r in enumerate(group):
            r["sample_index"] = k
        records += group
    diagnoses = [bfcl_diagnose.diagnose(next(t for t in tasks if t["id"] == r["task_id"]), r) for r in records]
    folder = tmp_path_factory.mktemp("learning")
    write_jsonl(folder / "rollouts.jsonl", records)
    write_jsonl(folder / "diagnoses.jsonl", diagnoses)
    return folder, records, [d["reward"] for d in diagnoses], model


def test_one_round_moves_logprobs_towards_the_reward(tiny_model, batch):
    from transformers import AutoModelForCausalLM
    folder, records, rewards, model = batch
    # the teacher's two trajectories per group: the official checker says 1 and 0
    assert rewards[SAMPLES::SAMPLES + 2] == [1, 1] and rewards[SAMPLES + 1::SAMPLES + 2] == [0, 0]
    res = in_process(["--model", tiny_model, "--rollouts", str(folder / "rollouts.jsonl"),
                      "--diagnoses", str(folder / "diagnoses.jsonl"), "--no-reweight", "--lr", "1e-4",
                      "--kl-coef", "0", "--mini-batch-tasks", "2", "--cpu", "--out", str(folder / "policy")])
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = [json.loads(line) for line in open(folder / "train_metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1]
    after = AutoModelForCausalLM.from_pretrained(folder / "policy").eval()
    # Advantage sign = reward above or below the group mean; a group all of one reward moves nothing.
    up, down = [], []
    for task_id in dict.fromkeys(r["task_id"] for r in records):
        idx = [i for i, r in enumerate(records) if r["task_id"] == task_id]
        mean = sum(rewards[i] for i in idx) / len(idx)
        delta = {i: seq_logprob(after, records[i]) - seq_logprob(model, records[i]) for i in idx}
        print(task_id, [(rewards[i], round(delta[i], 4)) for i in idx])
        pos = [delta[i] for i in idx if rewards[i] > mean]
        neg = [delta[i] for i in idx if rewards[i] < mean]
        # within every group the rewarded trajectories gain against the others
        assert sum(pos) / len(pos) > sum(neg) / len(neg), (task_id, pos, neg)
        up += pos
        down += neg
    # and over the batch the rewarded ones gain log-probability and the others lose it
    assert sum(up) / len(up) > 0 > sum(down) / len(down), (up, down)
