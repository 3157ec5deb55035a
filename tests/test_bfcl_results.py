"""bfcl-eval's own evaluation runner on the result files evaluate.py writes (common/envs/bfcl/results.py).

The runner is run as users run it (docs/bfcl-results.md): `bfcl evaluate --partial-eval` in a
process of its own, since its executor caches tool instances in module globals by model name
and entry id, so two runs in one process would share the state of the same entries.

Like with like: with --partial-eval, bfcl's accuracy per category is over the entries present
in the result files (save_eval_results: correct_count / len(model_result)), as our scores.json is
the percent of the tasks played per category; its multi-turn overall accuracy is the unweighted
mean of its four categories (calculate_unweighted_accuracy), as our average is when all four
were played (it shows N/A when one is missing).
"""

import csv
import json
import os
import subprocess
import sys

import pytest

from common.engine import calls as C
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import prompts
from common.envs.bfcl import results as bfcl_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = prompts.registry_name("QwenFCHandler")
HANDLERS = {"json": "QwenFCHandler", "python": "LlamaHandler"}  # the handler that decodes each format


def evaluate(out, *args):
    res = subprocess.run([sys.executable, "evaluate.py", *args, "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]


def bfcl_evaluate(out, tmp_path, model=MODEL, partial=True):
    """bfcl-eval's runner on out/result: ({task id: error type, None if valid}, {category: accuracy %}, overall %).
    Without `partial`, as the leaderboard runs it: every entry of each category must be there."""
    env = {**os.environ, "BFCL_PROJECT_ROOT": str(tmp_path / "bfcl-root")}
    res = subprocess.run([sys.executable, "-m", "bfcl_eval", "evaluate", "--model", model, "--test-category",
                          "multi_turn", "--result-dir", str(out / "result"), "--score-dir", str(out / "score")]
                         + ["--partial-eval"] * partial, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    played = [json.loads(line)["id"] for f in (out / "result" / dir_name(model) / "multi_turn").iterdir()
              for line in f.read_text().splitlines()]
    errors, scores = dict.fromkeys(played), {}
    for cat in bfcl.CATEGORIES:
        path = out / "score" / dir_name(model) / "multi_turn" / f"BFCL_v4_multi_turn_{cat}_score.json"
        header, *failed = [json.loads(line) for line in path.read_text().splitlines()]
        scores[cat] = round(100 * header["accuracy"], 2)
        assert header["total_count"] == sum(i.startswith(f"multi_turn_{cat}_") for i in played)
        for entry in failed:
            errors[entry["id"]] = entry["error"]["error_type"]
    with open(out / "score" / "data_multi_turn.csv") as f:
        overall = float(next(csv.DictReader(f))["Multi Turn Overall Acc"].rstrip("%"))
    return errors, scores, overall


def ours(out):
    valid = {json.loads(line)["task_id"]: json.loads(line)["valid"]
             for line in (out / "results.jsonl").read_text().splitlines()}
    return valid, json.loads((out / "scores.json").read_text())


def dir_name(model):
    return model.replace("/", "_")


def assert_same_verdicts(out, tmp_path, model=MODEL):
    valid, scores = ours(out)
    bfcl_errors, bfcl_scores, overall = bfcl_evaluate(out, tmp_path, model)
    assert {i: e is None for i, e in bfcl_errors.items()} == valid
    assert bfcl_scores == {c: scores[c] for c in bfcl.CATEGORIES}
    assert abs(overall - scores["average"]) <= 0.01  # both round to 2 decimals, at different points


@pytest.mark.parametrize("fmt", ["json", "python"])
def test_oracle_result_files_score_the_same_in_bfcl_evals_runner(tmp_path, fmt):
    """The ground truth written as Qwen's <tool_call> blocks (QwenFCHandler decodes them) and as
    ToolACE's Python list (its LlamaHandler's default prompting decoder)."""
    out, model = tmp_path / "oracle", prompts.registry_name(HANDLERS[fmt])
    evaluate(out, "--policy", "oracle", "--split", "heldin", "--limit", "2", "--handler", HANDLERS[fmt])
    files = sorted(p.name for p in (out / "result" / dir_name(model) / "multi_turn").iterdir())
    assert files == sorted(f"BFCL_v4_multi_turn_{c}_result.json" for c in bfcl.CATEGORIES)
    for f in (out / "result" / dir_name(model) / "multi_turn").iterdir():
        entries = [json.loads(line) for line in f.read_text().splitlines()]
        assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), key=lambda i: int(i.rsplit("_", 1)[1]))
        for e in entries:
            shape = [len(turn) for turn in e["result"]]
            for key in ("input_token_count", "output_token_count", "latency"):
                assert [len(turn) for turn in e[key]] == shape
            assert [sum(k.startswith("step_") for k in turn) for turn in e["inference_log"]] == shape
    assert_same_verdicts(out, tmp_path, model)


def test_tiny_model_result_files_score_the_same_in_bfcl_evals_runner(tmp_path, tiny_model, tiny_server):
    out = tmp_path / "tiny"
    evaluate(out, "--policy", tiny_model, "--server", tiny_server, "--limit", "1", "--max-new-tokens", "32")
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    entries = {json.loads(line)["id"]: json.loads(line)
               for f in (out / "result" / dir_name(MODEL) / "multi_turn").iterdir()
               for line in f.read_text().splitlines()}
    for rec in rollouts:
        e = entries[rec["task_id"]]
        assert e["result"] == [[s["text"] for s in turn["steps"]] for turn in rec["turns"]]  # no <think> part
        assert sum(map(sum, e["output_token_count"])) == rec["stats"]["gen_tokens"]
    assert_same_verdicts(out, tmp_path)


def test_tasks_bfcl_eval_does_not_have_get_no_result_file(tmp_path):
    """The tiny preset's tasks, cut to their first turn, are not bfcl-eval's entries: evaluating
    them writes our scores and no result file (bfcl-eval's writer would fail sorting their ids)."""
    out = tmp_path / "tiny"
    evaluate(out, "--policy", "oracle", "--split", "train", "--tasks", os.path.join(ROOT, "data", "tiny.jsonl"))
    assert json.loads((out / "scores.json").read_text())["average"] == 100.0
    assert not list(out.rglob("*_result.json"))
    assert bfcl_results.bfcl_entry("multi_turn_base_12") and not bfcl_results.bfcl_entry("multi_turn_base_2_1turn")


def test_all_800_tasks_result_files_are_scored_as_the_leaderboard_scores_them(tmp_path):
    """`--split all` writes an entry for each of the 800 tasks, which bfcl-eval's runner scores
    without --partial-eval (it refuses a category with an entry missing). Played here: the oracle
    on the first two tasks of each category; the others as unplayed entries (no turn), which both
    checkers fail as force-terminated."""
    from common.envs.bfcl import evaluate

    tasks, _ = evaluate.split_tasks("all")
    played = {t["id"] for t in bfcl.first_per_category(tasks, 2)}
    records, results = [], []
    for task in tasks:
        decoded, turns = evaluate.oracle_trajectory(task, "json") if task["id"] in played else ([], [])
        records.append({"task_id": task["id"], "turns": turns, "stop": "done"})
        results.append({"task_id": task["id"], "category": task["category"], **bfcl.official_verdict(task, decoded)})
    out = tmp_path / "out"
    files = bfcl_results.write_result_files(out, tasks, records, MODEL)
    assert [sum(1 for _ in open(f)) for f in files] == [200] * 4
    errors, scores, overall = bfcl_evaluate(out, tmp_path, partial=False)
    assert errors == {r["task_id"]: r["error_type"] for r in results}
    assert {i for i, e in errors.items() if e is None} == played
    assert set(errors.values()) == {None, "multi_turn:force_terminated"}
    ours = evaluate.category_scores(results)  # 2 of 200 per category
    assert scores == {c: ours[c] for c in bfcl.CATEGORIES} == dict.fromkeys(bfcl.CATEGORIES, 1.0)
    assert overall == ours["average"] == 1.0


@pytest.fixture(scope="module")
def task(heldin):
    return heldin["multi_turn_base_1"]


def gt_text(task, turn):
    return C.format_calls(bfcl.ground_truth_calls(task, turn), "json")


# Ground-truth plays, each spoiled one way: per turn, the texts the "model" writes.
SPOILERS = {
    "ground truth": lambda task, t: [gt_text(task, t)] if task["ground_truth"][t] else ["Nothing to do."],
    "reasoning first": lambda task, t: [f"<think>\nturn {t}\n</think>\n\n{gt_text(task, t)}"],
    "last call dropped": lambda task, t: [C.format_calls(bfcl.ground_truth_calls(task, t)[:-1], "json")]
    if t == 0 else [gt_text(task, t)],
    "unknown tool first": lambda task, t: [C.format_calls([{"name": "wipe_disk", "arguments": {}}], "json"),
                                           gt_text(task, t)],
    "wrong argument type": lambda task, t: [C.format_calls([{**c, "arguments": {k: [v] for k, v in c["arguments"].items()}}
                                                           for c in bfcl.ground_truth_calls(task, t)], "json")],
    "broken block": lambda task, t: ["<tool_call>\n{\"name\": \"ls\", \"arguments\": {\n</tool_call>"]
    if t == 1 else [gt_text(task, t)],
    "answers only": lambda task, t: ["I did it."],
}


def test_spoiled_plays_get_bfcl_evals_verdicts(tmp_path, heldin):
    """Valid and failing plays of several kinds, written as result files, get the same verdict
    from bfcl-eval's runner (its decoder, executor and checker) as from bfcl.official_verdict."""
    tasks = bfcl.first_per_category(list(heldin.values()), 2)
    records, results = [], []
    for i, task in enumerate(tasks):
        spoil = list(SPOILERS.values())[i % len(SPOILERS)]
        n = len(task["ground_truth"]) - (i == len(tasks) - 1)  # and the last play stops a turn early
        turns = []
        with bfcl.Environment(task) as env:
            for t in range(n):
                env.start_turn(t)
                steps = [{"text": text, **env.step(text, "json")} for text in spoil(task, t)]
                turns.append({"steps": steps, "end": "answer"})
            decoded = env.decoded
        records.append({"task_id": task["id"], "turns": turns, "stop": "done"})
        results.append({"task_id": task["id"], "category": task["category"], **bfcl.official_verdict(task, decoded)})
    bfcl_results.write_result_files(tmp_path / "out", tasks, records, MODEL)
    errors, scores, _ = bfcl_evaluate(tmp_path / "out", tmp_path)
    assert errors == {r["task_id"]: r["error_type"] for r in results}  # the same reason, too
    assert 0 < sum(e is None for e in errors.values()) < len(errors)
    for cat in bfcl.CATEGORIES:
        rows = [r["valid"] for r in results if r["category"] == cat]
        assert scores[cat] == round(100 * sum(rows) / len(rows), 2)


def test_an_entry_is_what_the_handler_parses_and_the_prompting_loop_logs(task):
    h = bfcl_results.handler(MODEL)
    calls = bfcl.ground_truth_calls(task, 0)
    text = C.format_calls(calls, "json")
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        step = {"text": f"<think>\nList it.\n</think>\n\n{text}", **env.step(text, "json"),
                "formatted_prompt": "<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n"}
    answer = {"text": "Done.", "calls": [], "parse_error": None, "results": []}
    entry = bfcl_results.result_entry(h, task, {"turns": [{"steps": [step, answer]}], "stop": "done"})
    assert entry["result"] == [[text, "Done."]]
    assert entry["reasoning_content"] == [["List it.", ""]]
    first, second = entry["inference_log"][0]["step_0"], entry["inference_log"][0]["step_1"]
    assert first[0] == {"role": "inference_input", "content": {"formatted_prompt": step["formatted_prompt"]}}
    assert first[1] == {"role": "assistant", "content": text, "reasoning_content": "List it."}
    assert first[2]["model_response_decoded"] == [f"{c['name']}(" + ",".join(f"{k}={v!r}" for k, v in
                                                  c["arguments"].items()) + ")" for c in calls]
    assert [e["content"] for e in first[3:]] == step["results"]
    assert [e["role"] for e in second] == ["assistant", "handler_log", "handler_log"]  # decoded nothing: turn ends
    failed = bfcl_results.result_entry(h, task, {"inference_error": "prompt is 20000 tokens", "turns": []})
    assert failed == {"id": task["id"], "result": "Error during inference: prompt is 20000 tokens"}


def test_a_name_outside_bfcls_registry_or_an_api_model_is_refused(tmp_path):
    for name in ("Qwen/Qwen2.5-7B-Instruct-FC", "gpt-4o-2024-11-20-FC"):
        res = subprocess.run([sys.executable, "evaluate.py", "--policy", "oracle", "--bfcl-model", name,
                              "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode != 0 and "--bfcl-model" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()
