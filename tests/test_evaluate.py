"""evaluate.py's task sets: `--split all` is every multi-turn task bfcl-eval ships (the BFCL
leaderboard's 800), of which the paper's train/held-in split is a partition; nothing is played here
but a few oracle tasks."""

import json
import os
import subprocess
import sys

import evaluate
from common import bfcl, bfcl_results, playargs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_all_is_bfcl_evals_800_tasks_and_the_papers_split_partitions_them():
    tasks, which = evaluate.split_tasks("all")
    assert which == "bfcl-eval's 800 multi-turn tasks" and len(tasks) == bfcl_results.LEADERBOARD_TASKS
    assert [t["id"] for t in tasks] == [f"multi_turn_{c}_{i}" for c in bfcl.CATEGORIES for i in range(200)]
    assert all(t["category"] in t["id"] and bfcl_results.bfcl_entry(t["id"]) for t in tasks)
    with open(os.path.join(ROOT, "data", "split.json")) as f:
        split = json.load(f)
    assert not set(split["train"]) & set(split["heldin"])
    assert set(split["train"]) | set(split["heldin"]) == {t["id"] for t in tasks}
    # the same records as the split's files: a held-in task scores the same in either run
    by_id = {t["id"]: t for t in tasks}
    heldin, _ = evaluate.split_tasks("heldin")
    assert len(heldin) == 400 and all(t == by_id[t["id"]] for t in heldin)
    assert [t["id"] for t in bfcl.first_per_category(tasks, 2)] == [
        f"multi_turn_{c}_{i}" for c in bfcl.CATEGORIES for i in range(2)]
    # a task file still replaces the split
    tiny, which = evaluate.split_tasks("all", os.path.join(ROOT, "data", "tiny.jsonl"))
    assert which == os.path.relpath(os.path.join(ROOT, "data", "tiny.jsonl"))
    assert tiny and all(t["id"].endswith("_1turn") for t in tiny)


def test_the_oracle_solves_the_first_tasks_of_all(tmp_path):
    out = tmp_path / "all"
    res = subprocess.run([sys.executable, "evaluate.py", "--policy", "oracle", "--split", "all", "--limit", "1",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "oracle on 4 tasks of bfcl-eval's 800 multi-turn tasks" in res.stdout
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in results] == [f"multi_turn_{c}_0" for c in bfcl.CATEGORIES]
    assert json.loads((out / "scores.json").read_text())["average"] == 100.0


def test_the_leaderboard_note_says_whether_a_score_compares():
    entry = "Qwen/Qwen3-4B-Instruct-2507-FC"
    assert bfcl_results.leaderboard_note("Qwen/Qwen3-8B-FC", 800) is None  # no stated figure
    full, part = bfcl_results.leaderboard_note(entry, 800), bfcl_results.leaderboard_note(entry, 4)
    assert f"{entry} 22.12 over all 800 tasks" in full and "not comparable" not in full
    assert part.startswith(full) and "not comparable with a score over 4 tasks" in part


def test_evaluation_plays_as_bfcl_eval_unless_a_flag_departs_and_names_each_departure(tiny_model):
    """By default a policy plays as bfcl-eval's local inference (its decoding, the model's context,
    4096 new tokens a call, 20 steps a turn, Ω absent, every prompt re-rendered), and scores.json says
    the scores are bfcl-eval's; each flag that departs is named, so that no score is set beside the
    leaderboard's unawares."""
    from common.models import model_context

    context = model_context(tiny_model)

    def spec_and_differs(*flags):
        args = evaluate.parser.parse_args(["--policy", tiny_model, *flags])
        spec = playargs.eval_spec(args, evaluate.parser, decoding=args.decoding)
        return spec, evaluate.bfcl_settings(spec, context)

    spec, differs = spec_and_differs()
    assert differs == [] and spec.temperature["temperature"] == 0.001 and spec.omega is None and spec.rerender
    assert (spec.max_model_len, spec.max_new_tokens, spec.max_steps_per_turn) == (context, 4096, 20)
    for flags, named in [(["--decoding", "greedy"], "greedy decoding"), (["--max-new-tokens", "256"], "at most 256 new"),
                         (["--max-steps-per-turn", "3"], "3 steps per turn"),
                         (["--max-model-len", str(context // 2)], f"context {context // 2}")]:
        spec, differs = spec_and_differs(*flags)
        assert len(differs) == 1 and named in differs[0], (flags, differs)
