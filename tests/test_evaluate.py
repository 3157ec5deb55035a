"""evaluate.py, every environment's evaluation through the seam: BFCL's task sets (`--split all` is every
multi-turn task bfcl-eval ships, the leaderboard's 800, of which the paper's split is a partition), a τ²
split and τ²-bench's domains, each kind's flags refused for another's tasks; nothing is played here but a
few oracle tasks and one tiny-model episode."""

import json
import os
import subprocess
import sys

import evaluate
from common import envs
from common.engine import playargs
from common.envs.bfcl import evaluate as bfcl_eval
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import results as bfcl_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_all_is_bfcl_evals_800_tasks_and_the_papers_split_partitions_them():
    tasks, which = bfcl_eval.split_tasks("all")
    assert which == "bfcl-eval's 800 multi-turn tasks" and len(tasks) == bfcl_results.LEADERBOARD_TASKS
    assert [t["id"] for t in tasks] == [f"multi_turn_{c}_{i}" for c in bfcl.CATEGORIES for i in range(200)]
    assert all(t["category"] in t["id"] and bfcl_results.bfcl_entry(t["id"]) for t in tasks)
    with open(os.path.join(ROOT, "data", "split.json")) as f:
        split = json.load(f)
    assert not set(split["train"]) & set(split["heldin"])
    assert set(split["train"]) | set(split["heldin"]) == {t["id"] for t in tasks}
    # the same records as the split's files: a held-in task scores the same in either run
    by_id = {t["id"]: t for t in tasks}
    heldin, _ = bfcl_eval.split_tasks("heldin")
    assert len(heldin) == 400 and all(t == by_id[t["id"]] for t in heldin)
    assert [t["id"] for t in bfcl.first_per_category(tasks, 2)] == [
        f"multi_turn_{c}_{i}" for c in bfcl.CATEGORIES for i in range(2)]
    # a task file still replaces the split
    tiny, which = bfcl_eval.split_tasks("all", os.path.join(ROOT, "data", "tiny.jsonl"))
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
    from common.engine.models import model_context

    context = model_context(tiny_model)

    def spec_and_differs(*flags):
        args = evaluate.parser.parse_args(["--policy", tiny_model, *flags])
        env = envs.load(args.tasks, args, evaluate.parser, evaluation=True)  # BFCL held-in: bfcl-eval's decoding
        spec = playargs.eval_spec(args, evaluate.parser, decoding=env.decoding)
        return spec, bfcl_eval.bfcl_settings(spec, context)

    spec, differs = spec_and_differs()
    assert differs == [] and spec.temperature["temperature"] == 0.001 and spec.omega is None and spec.rerender
    assert (spec.max_model_len, spec.max_new_tokens, spec.max_steps_per_turn) == (context, 4096, 20)
    for flags, named in [(["--decoding", "greedy"], "greedy decoding"), (["--max-new-tokens", "256"], "at most 256 new"),
                         (["--max-steps-per-turn", "3"], "3 steps per turn"),
                         (["--max-model-len", str(context // 2)], f"context {context // 2}")]:
        spec, differs = spec_and_differs(*flags)
        assert len(differs) == 1 and named in differs[0], (flags, differs)


TAU2_SCORE_KEYS = {"average", "trials", "pass_k", "user_simulator", "policy", "limit", "split", "tau2_version",
                   "call_format", "tasks", "terminations", "seconds"}


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _read(out):
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # an episode's timings and its transcript's timestamps differ from run to run; the rest is the episode's
    return [{k: v for k, v in r.items() if k not in ("seconds", "transcript")} | {"roles": [m["role"] for m in r["transcript"]]}
            for r in rows], json.loads((out / "scores.json").read_text())


def test_a_tau2_split_is_scored_through_the_seam_with_pass_k(tmp_path):
    """evaluate.py --tasks tau2:DOMAIN:SPLIT: τ²'s evaluator with pass^k (the oracle: gold actions, a scripted
    user), and none of bfcl-eval's files; --tasks tau2:DOMAIN without a split is the paper's task set."""
    seam = tmp_path / "seam"
    res = _run("evaluate.py", "--policy", "oracle", "--tasks", "tau2:airline:test", "--limit", "1", "--trials", "2",
               "--out", str(seam))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pass^2 over 2 trials" in res.stdout
    rows, scores = _read(seam)
    assert set(scores) == TAU2_SCORE_KEYS | {"airline"}
    assert scores["split"] == "test" and scores["tasks"] == {"airline": 1} and scores["airline"] == 100.0
    assert scores["pass_k"]["airline"] == {"1": 100.0, "2": 100.0} and [r["trial"] for r in rows] == [0, 1]
    assert not (seam / "result").exists() and not (seam / "rollouts.jsonl").exists()  # bfcl-eval's files: BFCL's
    res = _run("evaluate.py", "--policy", "oracle", "--tasks", "tau2:retail", "--limit", "1", "--out", str(tmp_path / "p"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert _read(tmp_path / "p")[1]["split"] == "the paper's set"


def test_a_model_plays_a_tau2_split_against_the_scripted_user(tmp_path, tiny_model):
    out = tmp_path / "mock"
    res = _run("evaluate.py", "--tasks", "tau2:mock:base", "--scripted-user", "--engine", "hf", "--policy", tiny_model,
               "--limit", "1", "--max-new-tokens", "24", "--max-episode-steps", "6", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows, scores = _read(out)
    assert set(scores) == TAU2_SCORE_KEYS | {"mock"}
    assert scores["user_simulator"]["kind"] == "scripted" and scores["policy"] == os.path.abspath(tiny_model)
    assert scores["split"] == "base" and scores["tasks"] == {"mock": 1} and scores["trials"] == 1
    assert len(rows) == 1 and rows[0]["domain"] == "mock" and 0.0 <= rows[0]["reward"] <= 1.0
    assert 0.0 <= scores["mock"] <= 100.0 and scores["average"] == scores["mock"]


def test_bad_tasks_and_flags_of_another_environment_are_refused(tmp_path):
    out = tmp_path / "none"
    for args, message in [
            (["--tasks", "tau2:airline:test:x"], "τ² tasks are named tau2:DOMAIN:SPLIT"),
            (["--tasks", "tau2:nosuch:test"], "τ² domain 'nosuch'"),
            (["--tasks", "tau2:airline:nosuch"], "Invalid task split name: nosuch"),
            (["--tasks", "no/such/tasks.jsonl"], "no such task file (a BFCL task file, or KIND:..."),
            (["--tasks", "tau2:airline:test", "--split", "heldin"], "--split: for bfcl tasks, not tau2:airline:test"),
            (["--tasks", "bfcl-memory", "--split", "all"], "--split and --bfcl-model are BFCL multi-turn's"),
            (["--memory-scenario", "student"], "--memory-backend and --memory-scenario are for --tasks"),
            (["--tasks", "tau2:airline:test", "--trials", "0"], "must be at least 1"),
            (["--tasks", "tau2:airline:test", "--scripted-user"], "takes no user simulator"),
            (["--split", "heldin", "--scripted-user"], "--scripted-user: for tau2 tasks, not BFCL held-in"),
            (["--trials", "2"], "--trials: for tau2 tasks")]:
        res = _run("evaluate.py", "--policy", "oracle", *args, "--out", str(out))
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
    assert not out.exists()
