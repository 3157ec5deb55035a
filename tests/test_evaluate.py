"""evaluate.py's task sets: `--split all` is every multi-turn task bfcl-eval ships (the BFCL
leaderboard's 800), of which the paper's train/held-in split is a partition; nothing is played here
but a few oracle tasks."""

import json
import os
import subprocess
import sys

import evaluate
from common import bfcl, bfcl_results

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


def test_an_unknown_split_is_refused_naming_the_choices(tmp_path):
    res = subprocess.run([sys.executable, "evaluate.py", "--policy", "oracle", "--split", "dev",
                          "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--split: invalid choice: 'dev'" in res.stderr
    assert "'heldin', 'train', 'all'" in res.stderr
    assert not (tmp_path / "o").exists()
