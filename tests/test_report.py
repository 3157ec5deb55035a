"""common/run/report.py on a hand-made run folder: a live run's missing artifacts are empty, the
figures come from the files, report.md appears whole (no temporary file left beside it)."""

import json
import os

import pytest

from common.run import report
from common.seal.taxonomy import LABELS, RHO


def _write(path, obj, lines=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in obj) if lines else json.dumps(obj))


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the empty run's plots
def test_report_of_a_live_run(tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    _write(str(run / "config.json"), {"settings": {"preset": "tiny", "mode": "seal", "model": "m"},
                                      "git_commit": "0123456789abcdef"})
    _write(str(run / "timing.jsonl"), [{"round": 0, "stage": "rollout", "seconds": 2.5},
                                       {"round": 0, "stage": "train", "seconds": 1.0}], lines=True)
    r0 = run / "round_000"
    _write(str(r0 / "interface.json"), {"schema_cue": {"enabled": True}, "error_feedback": False,
                                        "capability_cues": [{"label": "missing_tool_call"}], "rho": RHO})
    _write(str(r0 / "diagnoses.jsonl"), [
        {"reward": 1, "category": "base", "turn_labels": ["pass", "pass"]},
        {"reward": 0, "category": "base", "turn_labels": ["missing_tool_call"]},
        {"reward": 0, "category": "miss_func", "turn_labels": ["pass", "missing_tool_call"]},
        {"reward": 1, "category": "miss_func", "turn_labels": ["pass", "missing_tool_call"]}], lines=True)
    _write(str(r0 / "train_metrics.jsonl"), [{"w_mean": 1.5, "step": 1, "global_step": 1, "entropy": 0.5},
                                             {"w_mean": 1.0, "step": 2, "global_step": 2, "entropy": 0.25}], lines=True)
    _write(str(r0 / "rollout_summary.json"), {"gen_tokens": 123, "cue_tokens": 7})
    _write(str(run / "round_001" / "interface.json"), {})  # Ω of the next round before its rollouts
    scores = {"base": 50.0, "miss_func": 25.0, "miss_param": 0.0, "long_context": 100.0, "average": 43.75}
    _write(str(run / "eval" / "round_000" / "scores.json"), scores)
    _write(str(tmp_path / "runs" / "base-tiny" / "eval" / "scores.json"), scores | {"average": 40.0})

    rounds, evals, base, _ = report.collect(str(run))
    assert [r["round"] for r in rounds] == [0]
    assert rounds[0]["reward"] == 0.5 and rounds[0]["reward_by_category"] == {"base": 0.5, "miss_func": 0.5}
    assert rounds[0]["label_share"]["missing_tool_call"] == 3 / 7
    assert (rounds[0]["w_mean"], rounds[0]["steps"], rounds[0]["global_step"]) == (1.25, 2, 2)
    assert rounds[0]["entropy"] == 0.375  # the mean of the round's steps
    assert rounds[0]["seconds"]["rollout"] == 2.5 and rounds[0]["seconds"]["eval"] == 0
    assert evals == {"round_000": scores} and base["average"] == 40.0

    report.main(str(run))
    text = (run / "report.md").read_text()
    assert capsys.readouterr().out == text + "\n"
    assert "| 0 | 0.500 | 1.250 | 0.375 | 2 (2) | schema, cap:missing_tool_call | 123 | 7 |" in text
    assert "| base | 50.00 | 25.00 | 0.00 | 100.00 | 40.00 |" in text
    assert "| 0 | " + " | ".join(f"{RHO[z]:.3f}" for z in LABELS) + " |" in text  # ρ per label, the table
    assert "| round_000 | 50.00 | 25.00 | 0.00 | 100.00 | 43.75 |" in text
    assert sorted(os.listdir(run)) == ["config.json", "curves.png", "eval", "report.md", "round_000", "round_001",
                                       "timing.jsonl"]

    # a run with nothing yet but its config still reports
    empty = tmp_path / "runs" / "e"
    _write(str(empty / "config.json"), {})
    report.main(str(empty))
    assert "## Rounds" in (empty / "report.md").read_text()


def test_compare_and_trackers_read_runs_one_way(tmp_path, capsys):
    """common/run/runs.py is the one reader of a run folder: `evaluate.py --compare` (report.compare)
    prints each preset's base model once, then every evaluated round of each run, and the
    Table-2 block from the OOD scores; the trackers' units come from the same folders. A
    folder under eval/ that is not a round's (a bench run by hand) is no round's score."""
    from common.run import runs, tracking

    held = {"base": 50.0, "miss_func": 25.0, "miss_param": 0.0, "long_context": 100.0, "average": 43.75}
    for name in ("seal", "vanilla"):
        run = tmp_path / name
        _write(str(run / "config.json"), {"settings": {"preset": "tiny", "max_new_tokens": "96", "mode": name}})
        _write(str(run / "timing.jsonl"), [{"round": 1, "stage": "eval", "seconds": 3.0}], lines=True)
        _write(str(run / "eval" / "round_001" / "scores.json"), held | {"average": 60.0 if name == "seal" else 45.0})
    _write(str(tmp_path / "seal" / "eval" / "memory" / "scores.json"), {"memory": 10.0})
    _write(str(tmp_path / "seal" / "ood" / "round_001" / "tau2" / "scores.json"),
           {"retail": 20.0, "average": 20.0, "user_simulator": {"kind": "endpoint", "name": "user-7b"}})
    _write(str(tmp_path / "base-tiny" / "eval" / "scores.json"), held)
    _write(str(tmp_path / "base-tiny" / "ood" / "tau2" / "scores.json"), {"retail": 10.0, "average": 10.0})

    run = runs.Run(str(tmp_path / "seal"))
    assert [t for t, _ in run.evals()] == [1] and run.base_eval() == held
    assert run.ood() == [(1, {"tau2": json.loads((tmp_path / "seal" / "ood" / "round_001" / "tau2" /
                                                   "scores.json").read_text())})]
    assert run.seconds(1) == dict.fromkeys(runs.STAGES, 0) | {"eval": 3.0}

    rows = report.compare([str(tmp_path / "seal"), str(tmp_path / "vanilla")])
    assert [(name, sc["average"]) for name, sc in rows] == [("tiny base", 43.75), ("seal r001", 60.0),
                                                            ("vanilla r001", 45.0)]
    out = capsys.readouterr().out.splitlines()
    # every row says the mode its run trained in (— for the base model)
    assert [line.split()[:3] for line in out[1:4]] == [["tiny", "base", "—"], ["seal", "r001", "seal"],
                                                       ["vanilla", "r001", "vanilla"]]
    ood = out[out.index("Out of distribution (Table 2): BFCL V4 memory (web search where it ran) and τ²-bench") + 2:]
    assert [line.split()[:3] for line in ood] == [["tiny", "base", "—"], ["seal", "r001", "seal"]]
    assert ood[1].endswith("user-7b") and "20.00" in ood[1] and "10.00" in ood[0]
    with pytest.raises(report.RecordError, match="no such run folder"):
        report.compare([str(tmp_path / "none")])

    units, _ = tracking.units(str(tmp_path / "seal"))
    assert [(step, key) for step, key, _ in units] == [(0, "eval base"), (2, "eval round 1"), (2, "ood 1 tau2")]
    assert units[1][2]["val-core/heldin/average"] == 60.0 and units[1][2]["timing_s/eval"] == 3.0
    assert units[2][2]["val-core/ood/tau2/retail"] == 20.0 and units[2][2]["val-core/ood-base/tau2/retail"] == 10.0


def test_compare_sets_the_leaderboards_figure_beside_a_score_of_all_800_tasks(tmp_path, capsys):
    """An evaluation folder (evaluate.py --out of --split all) is a row of its own; the leaderboard's
    figure of the bfcl-eval entry it was scored under follows the table once, in the average's
    column, and a row of that entry over fewer tasks is marked as not comparable with it."""
    from common.envs.bfcl.results import LEADERBOARD

    entry = "Qwen/Qwen3-4B-Instruct-2507-FC"
    figure, source = LEADERBOARD[entry]
    held = {"base": 30.0, "miss_func": 20.0, "miss_param": 10.0, "long_context": 20.0, "average": 20.0}
    meta = {"handler": "QwenFCHandler", "registry": entry, "context": 262144, "same_settings": True, "differs": []}
    _write(str(tmp_path / "qwen3-4b-all" / "scores.json"), held | {"bfcl_eval": meta | {"tasks": 800}})
    run = tmp_path / "runs" / "q"
    _write(str(run / "config.json"), {"settings": {"preset": "qwen3-4b"}})
    _write(str(tmp_path / "runs" / "base-qwen3-4b" / "eval" / "scores.json"),
           held | {"average": 25.0, "bfcl_eval": meta | {"tasks": 400}})
    _write(str(run / "eval" / "round_001" / "scores.json"), held | {"bfcl_eval": meta | {"tasks": 400}})
    # an entry without a figure gets no leaderboard row, whatever its task count
    _write(str(tmp_path / "q8-all" / "scores.json"), held | {"bfcl_eval": meta | {"registry": "Qwen/Qwen3-8B-FC",
                                                                                   "tasks": 800}})

    rows = report.compare([str(tmp_path / "qwen3-4b-all"), str(run), str(tmp_path / "q8-all")])
    assert [(name, sc["average"]) for name, sc in rows] == [("qwen3-4b-all", 20.0), ("qwen3-4b base", 25.0),
                                                            ("q r001", 20.0), ("q8-all", 20.0)]
    lines = capsys.readouterr().out.splitlines()
    board = [line for line in lines if line.startswith("BFCL leaderboard")]
    assert len(board) == 1 and board[0].split()[2:7] == ["—"] * 4 + [f"{figure:.2f}"]
    assert board[0].endswith(f"{entry}, all 800 tasks ({source})")
    marked = [line.split()[0] for line in lines if "†" in line]
    assert marked == ["qwen3-4b", "q"] and "† 400 tasks" in lines[2]
    assert lines.index(board[0]) == len(rows) + 1  # right below the table


def test_compare_marks_the_research_modes(tmp_path, capsys):
    """`--compare` lists seal-turn and seal-adaptive beside seal, each row marked as a mode beyond the
    paper that no GPU run has tested: their scores are shown, and no claim made of them."""
    held = {"base": 50.0, "miss_func": 25.0, "miss_param": 0.0, "long_context": 100.0, "average": 43.75}
    for mode in ("seal", "seal-adaptive", "seal-turn"):
        _write(str(tmp_path / mode / "config.json"), {"settings": {"preset": "tiny", "mode": mode}})
        _write(str(tmp_path / mode / "eval" / "round_001" / "scores.json"), held)
    report.compare([str(tmp_path / m) for m in ("seal", "seal-adaptive", "seal-turn")])
    out = capsys.readouterr().out.splitlines()
    marks = {line.split()[0]: line.partition("‡ ")[2] for line in out[1:]}
    assert marks["seal"] == ""
    for mode in ("seal-adaptive", "seal-turn"):
        assert marks[mode] == f"{mode}: beyond the paper, a research mode no GPU run has tested (docs/design.md §6)"
