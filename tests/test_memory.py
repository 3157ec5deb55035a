"""BFCL V4 memory (common/envs/bfcl/memory.py, evaluate.py --tasks bfcl-memory) against bfcl-eval's own
data, backend classes and checker.

The oracle and the tiny model run through evaluate.py as a command. The notetaker scenario is the
cheapest (5 short prerequisite conversations), so the end-to-end runs use it.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from common.envs.bfcl import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTETAKER_PREREQS = 5


def evaluate_cli(out, *extra, env=None):
    cmd = [sys.executable, "evaluate.py", "--tasks", "bfcl-memory", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=600)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_questions_line_up_with_answers_and_prerequisites_chain(tmp_path):
    questions, chains = memory.load_category("memory_kv", tmp_path)
    assert len(questions) == 155
    assert questions[0]["id"] == "memory_kv_0-customer-0" and questions[0]["answers"] == ["Michael"]
    assert {c[0]["scenario"]: len(c) for c in chains} == {"customer": 10, "healthcare": 5, "finance": 7,
                                                         "student": 10, "notetaker": 5}
    assert all(c[0]["id"].endswith("-0") and c[0]["depends_on"] == [] for c in chains)
    # --limit K: the first K questions, and only their scenario's conversations
    questions, chains = memory.load_category("memory_rec_sum", tmp_path, limit=3)
    assert [q["id"] for q in questions] == [f"memory_rec_sum_{i}-customer-{i}" for i in range(3)]
    assert [c[0]["scenario"] for c in chains] == ["customer"]
    questions, chains = memory.load_category("memory_kv", tmp_path, scenario="notetaker", limit=2)
    cfg = questions[0]["initial_config"]["MemoryAPI_kv"]
    assert {q["scenario"] for q in questions} == {"notetaker"} and len(questions) == 2
    assert len(chains) == 1 and len(chains[0]) == NOTETAKER_PREREQS
    # web search (not runnable here) loads through the same path: no conversations, snapshot unused
    questions, chains = memory.load_category("web_search_no_snippet", tmp_path, limit=2)
    assert [q["id"] for q in questions] == ["web_search_no_snippet_0", "web_search_no_snippet_1"] and chains == []
    assert questions[0]["initial_config"] == {"WebSearchAPI": {"show_snippet": False}}
    assert questions[0]["answers"] == ["Zhang Yiming"]
    # the snapshot folder is ours, never bfcl-eval's package folder
    assert str(cfg["model_result_dir"]) == str(tmp_path)


def test_memory_prompt_is_bfcl_evals():
    """The memory instruction is bfcl-eval's own function (its module's tree_sitter is installed)."""
    from bfcl_eval.model_handler import utils
    assert memory.add_memory_instruction_system_prompt is utils.add_memory_instruction_system_prompt


def test_verdict_is_on_the_last_output_without_calls():
    call = {"text": "<tool_call>\n{}\n</tool_call>", "calls": [{"name": "memory_retrieve", "arguments": {}}]}
    answer = {"text": "<think>hmm</think>\n{'answer': 'Seattle', 'context': 'memory'}", "calls": []}
    rec = {"turns": [{"steps": [call, answer]}]}
    assert memory.verdict(rec, ["Seattle"], "json")["valid"]
    assert memory.final_answer(rec, "json") == "{'answer': 'Seattle', 'context': 'memory'}"
    assert memory.final_answer(rec, "python").startswith("<think>")  # bfcl-eval's prompting handlers keep it
    assert not memory.verdict(rec, ["Portland"], "json")["valid"]
    quit_ = {"turns": [{"steps": [call, call]}]}  # force-quit: no final answer
    assert memory.verdict(quit_, ["Seattle"], "json") == {"valid": False, "error_type": "agentic:no_last_message",
                                                          "answer": None}
    assert memory.verdict({"turns": [{"steps": [{"text": "", "calls": []}]}]}, ["x"], "json")["answer"] is None


AGENTIC_RUNS = [  # the outputs of a question's one turn, in order; the last has no calls (or all do)
    ["{'answer': 'Seattle', 'context': 'from memory'}"],
    ['<tool_call>\n{"name": "archival_memory_key_search", "arguments": {"query": "home"}}\n</tool_call>',
     "{'answer': 'Seattle', 'context': 'from memory'}"],
    ["<think>Maybe Seattle.</think>\n{'answer': 'Portland', 'context': 'guess'}"],
    ["<think>Maybe Portland.</think>\n\n{'answer': 'Seattle', 'context': 'guess'}"],
    ['<tool_call>\n{"name": "core_memory_retrieve", "arguments": {"key": "Seattle"'],  # unclosed: no calls
    ['<tool_call>\n{"name": "memory_retrieve", "arguments": {}}\n</tool_call>\n<tool_call>\n{bad}\n</tool_call>',
     "It is Seattle."],
    ['<tool_call>\n{"name": "memory_retrieve", "arguments": {}}\n</tool_call>'] * 2,  # force-quit: no answer
    [""],
    ["Seattle, Washington"],
    ["I live in seattle-ish places"],
]


@pytest.mark.parametrize("texts", AGENTIC_RUNS)
def test_verdict_equals_bfcl_evals_agentic_runner(texts):
    """Our verdict against bfcl-eval's _evaluate_single_agentic_entry, compiled from its installed
    source, with its Qwen handler's response parsing and decoder (tests/helpers.py)."""
    import types

    from bfcl_eval.eval_checker.agentic_eval.agentic_checker import agentic_checker
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response
    from helpers import _QWEN, bfcl_eval_decode

    from common.engine import calls as C

    # its module imports half of bfcl-eval (tree_sitter among it): compile the one function
    path = importlib.util.find_spec("bfcl_eval.eval_checker.eval_runner").origin
    with open(path) as f:
        [fn] = [n for n in ast.parse(f.read()).body
                if isinstance(n, ast.FunctionDef) and n.name == "_evaluate_single_agentic_entry"]
    for arg in fn.args.args:
        arg.annotation = None  # `handler: BaseHandler`
    runner = {"agentic_checker": agentic_checker, "is_empty_execute_response": is_empty_execute_response}
    exec(compile(ast.Module([fn], type_ignores=[]), path, "exec"), runner)  # noqa: S102 (bfcl-eval's code)
    handler = types.SimpleNamespace(_extract_tool_calls=_QWEN["_extract_tool_calls"])
    # what its inference loop stores per step: the Qwen handler's model_responses
    stored = [_QWEN["_parse_query_response_prompting"](handler, types.SimpleNamespace(
        choices=[types.SimpleNamespace(text=t)], usage=types.SimpleNamespace(prompt_tokens=0, completion_tokens=0))
    )["model_responses"] for t in texts]
    judge = types.SimpleNamespace(decode_execute=lambda r, has_tool_call_tag: bfcl_eval_decode(r))
    theirs = runner["_evaluate_single_agentic_entry"](judge, "memory_kv_1-customer-1", [stored], ["Seattle"],
                                                       {"question": []}, "m", "memory_kv")
    record = {"turns": [{"steps": [{"text": t, "calls": C.parse(t, "json")[0]} for t in texts]}]}
    ours = memory.verdict(record, ["Seattle"], "json")
    assert ours["valid"] == theirs["valid"]
    assert ours["error_type"] == (None if theirs["valid"] else theirs["error"]["error_type"])


def test_oracle_scores_100_on_every_backend(tmp_path):
    out = tmp_path / "oracle"
    res = evaluate_cli(out, "--policy", "oracle", "--memory-scenario", "notetaker", "--limit", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    assert {k: scores[k] for k in ("memory_kv", "memory_vector", "memory_rec_sum", "memory")} == \
        {"memory_kv": 100.0, "memory_vector": 100.0, "memory_rec_sum": 100.0, "memory": 100.0}
    assert scores["web_search"] is None and "not run" in scores["note"]
    assert scores["run"]["questions"] == {"memory_kv": 2, "memory_vector": 2, "memory_rec_sum": 2}
    assert scores["run"]["bfcl_eval"] == "2026.3.23"
    results = read_jsonl(out / "results.jsonl")
    assert [r["task_id"] for r in results] == [f"memory_{b}_{i}-notetaker-{i - 130}" for b in memory.BACKENDS
                                               for i in (130, 131)]
    assert all(r["valid"] and r["turns"][0]["end"] == "answer" for r in results)
    # Each prerequisite conversation wrote its topic into memory, and the next one read it back:
    # the final snapshot holds all five in order, and the question's prompt shows it (rec_sum's
    # whole memory is in context).
    prereqs = read_jsonl(out / "prereqs.jsonl")
    assert len(prereqs) == 3 * NOTETAKER_PREREQS
    topics = [p["topic"] for p in prereqs if p["task_id"].startswith("memory_kv_")]
    snap = out / "memory_snapshot"
    kv = json.loads((snap / "memory_kv" / "notetaker_final.json").read_text())
    assert list(kv["archival_memory"].values()) == topics
    vector = json.loads((snap / "memory_vector" / "notetaker_final.json").read_text())
    assert list(vector["archival_memory"]["store"].values()) == topics
    rec_sum = json.loads((snap / "memory_rec_sum" / "notetaker_final.json").read_text())
    assert rec_sum["memory"] == "".join(topics)
    assert len(list((snap / "memory_kv" / "prereq_checkpoints").iterdir())) == NOTETAKER_PREREQS
    question = next(r for r in results if r["category"] == "memory_rec_sum")
    assert question["messages"][0]["role"] == "system" and rec_sum["memory"] in question["messages"][0]["content"]


def test_tiny_model_plays_a_scenario_end_to_end(tmp_path, tiny_model, tiny_server):
    """The policy plays the prerequisite conversations (its own memory writes) and a question,
    greedy, on vLLM's server; the contract of the outputs, not what the model says."""
    out = tmp_path / "tiny"
    res = evaluate_cli(out, "--policy", tiny_model, "--server", tiny_server, "--memory-backend", "kv",
                       "--memory-scenario", "notetaker", "--limit", "1", "--max-new-tokens", "16",
                       "--max-steps-per-turn", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    assert scores["memory_kv"] in (0.0, 100.0) and scores["memory"] == scores["memory_kv"]
    assert scores["run"]["engine"] == "vllm" and scores["run"]["prerequisite_conversations"] == NOTETAKER_PREREQS
    [result] = read_jsonl(out / "results.jsonl")
    assert result["task_id"] == "memory_kv_130-notetaker-0" and isinstance(result["valid"], bool)
    assert result["valid"] == (scores["memory_kv"] == 100.0)
    assert result["stop"] in ("done", "step_limit", "context_limit")
    for step in result["turns"][0]["steps"]:
        assert set(step) >= {"text", "calls", "parse_error", "results", "call_errors"}
        assert len(step["results"]) == len(step["calls"])
    prereqs = read_jsonl(out / "prereqs.jsonl")
    assert [p["task_id"] for p in prereqs] == [f"memory_kv_prereq_{32 + k}-notetaker-{k}" for k in range(5)]
    for p in prereqs:
        assert p["turns"] and p["stats"]["gen_tokens"] > 0
    # every conversation's memory was written back, whatever the model stored
    snap = out / "memory_snapshot" / "memory_kv"
    assert sorted(f.name for f in (snap / "prereq_checkpoints").iterdir()) == \
        sorted(f"{p['task_id']}.json" for p in prereqs)
    assert set(json.loads((snap / "notetaker_final.json").read_text())) == {"core_memory", "archival_memory"}


def test_web_search_without_a_key_is_a_clear_error(tmp_path):
    out = tmp_path / "web"
    env = {k: v for k, v in os.environ.items() if k != memory.SEARCH_KEY}
    res = subprocess.run([sys.executable, "evaluate.py", "--tasks", "bfcl-web", "--policy", "oracle",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode != 0 and memory.SEARCH_KEY in res.stderr
    assert not out.exists()


def test_a_policy_that_is_not_a_model_is_a_clear_error(tmp_path):
    out = tmp_path / "bad"
    res = evaluate_cli(out, "--policy", str(tmp_path), "--memory-backend", "kv", "--limit", "1")
    assert res.returncode != 0 and "not a model" in res.stderr
    assert not out.exists()
