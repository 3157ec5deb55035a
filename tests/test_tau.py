"""τ²-bench through python -m ood.tau (ood/tau.py), on τ²'s own orchestrator and evaluator.

The oracle (gold actions replayed as model text, gold user actions by a scripted user)
must score 100 and a lazy oracle must not; the tiny model plays one task per domain as
the agent against itself served by vLLM's OpenAI server as the user simulator. The
contract is asserted (records, the simulator named, rewards in [0, 1], no server left
running), never what the tiny model says.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from common import tau2 as tau2_env
from ood import tau

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {"domain", "task_id", "reward", "termination", "error", "reward_info", "agent_steps", "transcript"}


def evaluate(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ood.tau", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def read_out(out):
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "scores.json").read_text())


@pytest.fixture(scope="module")
def tau2():
    return tau.import_tau2()


def test_oracle_scores_100_per_domain(tmp_path):
    out = tmp_path / "oracle"
    res = evaluate("--policy", "oracle", "--limit", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows, scores = read_out(out)
    assert [r["domain"] for r in rows] == ["retail"] * 2 + ["airline"] * 2 + ["telecom"] * 2
    assert all(ROW_KEYS <= set(r) and r["reward"] == 1.0 and r["termination"] == "user_stop" for r in rows)
    assert {k: scores[k] for k in ("retail", "airline", "telecom", "average")} == \
        {"retail": 100.0, "airline": 100.0, "telecom": 100.0, "average": 100.0}
    assert scores["user_simulator"]["kind"] == "scripted" and scores["tau2_version"] == "26.3"
    assert scores["limit"] == 2 and scores["tasks"] == {"retail": 2, "airline": 2, "telecom": 2}
    assert "user simulator: scripted (oracle)" in res.stdout
    # telecom's gold has user actions: the scripted user ran them with its own tools
    telecom_user_calls = [c for r in rows if r["domain"] == "telecom" for m in r["transcript"]
                          if m["role"] == "user" for c in (m.get("tool_calls") or [])]
    assert telecom_user_calls and all(c["requestor"] == "user" for c in telecom_user_calls)
    assert not list(out.glob(".tmp-*"))


@pytest.mark.parametrize("fmt", ["json", "python"])
def test_lazy_oracle_fails(tau2, monkeypatch, fmt):
    """The evaluator is live: dropping one gold assistant action, or the required information, scores 0."""
    task = next(t for t in tau2.tasks("retail", None) if t.evaluation_criteria.communicate_info
                and sum(a.requestor == "assistant" for a in t.evaluation_criteria.actions) > 1)
    assert tau2.play("retail", task, tau2.oracle, 50, fmt)["reward"] == 1.0

    class DropsLastWrite(tau.OracleScript):
        def __init__(self, task, fmt):
            super().__init__(task, fmt)
            self.actions = self.actions[:-1]

    class KeepsQuiet(tau.OracleScript):
        def __init__(self, task, fmt):
            super().__init__(task, fmt)
            self.info = []

    for lazy, component in ((DropsLastWrite, "DB"), (KeepsQuiet, "COMMUNICATE")):
        monkeypatch.setattr(tau2_env, "OracleScript", lazy)
        row = tau2.play("retail", task, tau2.oracle, 50, fmt)
        assert row["reward"] == 0.0 and row["reward_info"]["reward_breakdown"][component] == 0.0


def test_empty_agent_output_scores_zero(tau2):
    """τ²'s orchestrator raises on an empty agent message; here the episode ends as agent_error, reward 0."""
    task = tau2.tasks("airline", 1)[0]

    def players(task, tools, user_tools, system, fmt):
        _, user = tau2.oracle(task, tools, user_tools, system, fmt)
        return (lambda history, new: "  \n"), user

    row = tau2.play("airline", task, players, 50, "json")
    assert row["termination"] == "agent_error" and row["reward"] == 0.0
    assert "empty" in row["error"] and row["agent_steps"] == [{"text": "  \n", "calls": [], "parse_error": None}]
    assert [m["role"] for m in row["transcript"]] == ["assistant", "user"]  # τ²'s greeting, the user's request


def test_model_text_to_tau2_messages(tau2):
    msg = tau2.msg
    m, step = tau.to_assistant_message(
        msg, 'Let me look.\n<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "a_1"}}\n</tool_call>',
        "json", 3)
    assert m.content == "Let me look." and step["parse_error"] is None
    assert [(c.id, c.name, c.arguments, c.requestor) for c in m.tool_calls] == \
        [("call_3_0", "get_user_details", {"user_id": "a_1"}, "assistant")]
    m, step = tau.to_assistant_message(msg, "[get_order_details(order_id='#W1'), think(thought='x')]", "python", 0)
    assert m.content is None and [c.name for c in m.tool_calls] == ["get_order_details", "think"]
    # an output that does not decode into calls is a message to the user, as from a served model
    m, step = tau.to_assistant_message(msg, '<tool_call>\n{"name": "x", "arguments": {"a": \n</tool_call>', "json", 0)
    assert m.tool_calls is None and m.content.startswith("<tool_call>") and step["parse_error"]
    m, step = tau.to_assistant_message(msg, "[f(a=len('x') + 1)]", "python", 0)  # never computed
    assert m.tool_calls is None and step["parse_error"]
    assert tau.to_assistant_message(msg, "", "json", 0)[0] is None


def _servers(model, port=None):
    """Pids of live processes whose command line names vLLM's OpenAI server and `model` (and `port`:
    other test files may start and stop servers of their own meanwhile)."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd and model in cmd and (
                port is None or f"--port\0{port}\0" in cmd):
            pids.add(int(pid))
    return pids


def test_tiny_model_plays_each_domain_against_served_user(tmp_path, tiny_model, tiny_server):
    """Three episodes at once (their agent outputs batched), rows still in domain order. The
    agent plays on the session's server; the user simulator's server is the stage's own,
    started and stopped by it."""
    out = tmp_path / "tiny"
    t0 = time.perf_counter()
    res = evaluate("--policy", tiny_model, "--server", tiny_server, "--user-model", tiny_model, "--limit", "1",
                   "--engine", "vllm",
                   "--max-new-tokens", "24", "--user-max-tokens", "24", "--max-episode-steps", "4",
                   "--max-model-len", "16384", "--concurrency", "3", "--out", str(out), timeout=900)
    seconds = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    rows, scores = read_out(out)
    port = urllib.parse.urlparse(scores["user_simulator"]["base_url"]).port
    assert not _servers(tiny_model, port)  # the server ood/tau.py started is gone
    assert [r["domain"] for r in rows] == ["retail", "airline", "telecom"]
    for r in rows:
        assert ROW_KEYS <= set(r) and 0.0 <= r["reward"] <= 1.0
        assert r["agent_steps"] and r["tokens"]["generations"] == len(r["agent_steps"])
        assert r["transcript"][0]["role"] == "assistant" and any(m["role"] == "user" for m in r["transcript"])
    sim = scores["user_simulator"]
    assert sim["model"] == os.path.abspath(tiny_model) and sim["base_url"].startswith("http://127.0.0.1:")
    assert sim["kind"].startswith("vllm")
    assert sim["llm_args"]["temperature"] == 0.0 and sim["llm_args"]["max_tokens"] == 24
    assert all(0.0 <= scores[d] <= 100.0 for d in ("retail", "airline", "telecom", "average"))
    assert f"user simulator: {os.path.abspath(tiny_model)} at http://127.0.0.1:" in res.stdout
    print(f"tiny agent vs tiny user, 1 task per domain: {seconds:.0f} s, scores {scores}")


def test_trials_give_taus_pass_k(tmp_path):
    """--trials K plays every task K times, trial k with the seed τ²'s own runner gives it
    (random.seed(300), one randint per trial), and scores.json adds pass^1..pass^K from τ²'s
    pass_hat_k; a task solved in 2 of 3 trials counts 2/3 at pass^1, 1/3 at pass^2, 0 at pass^3."""
    import random
    out = tmp_path / "oracle"
    res = evaluate("--policy", "oracle", "--domain", "airline", "--limit", "2", "--trials", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows, scores = read_out(out)
    draw = random.Random(300)
    seeds = [draw.randint(0, 1000000) for _ in range(2)]
    assert [(r["task_id"], r["trial"], r["seed"]) for r in rows] == \
        [(t, k, seeds[k]) for t in sorted({r["task_id"] for r in rows}, key=[r["task_id"] for r in rows].index)
         for k in range(2)]
    assert scores["trials"] == 2 and scores["pass_k"]["airline"] == {"1": 100.0, "2": 100.0}
    assert "pass^2 over 2 trials" in res.stdout
    made = [{"domain": "d", "task_id": "a", "reward": r} for r in (1.0, 0.0, 1.0)] + \
        [{"domain": "d", "task_id": "b", "reward": 1.0}] * 3
    got = tau.pass_k(made, ["d"], 3)
    assert got["d"] == {"1": 83.33, "2": 66.67, "3": 50.0}  # percent, two decimals as every score
    assert got["average"] == got["d"]
    assert evaluate("--policy", "oracle", "--trials", "0", "--out", str(tmp_path / "x")).returncode == 2


def test_bad_input_clear_error_and_no_output(tmp_path, tiny_model):
    out = tmp_path / "none"
    res = evaluate("--policy", tiny_model, "--out", str(out))
    assert res.returncode != 0 and "needs a user simulator" in res.stderr
    with socket.socket() as s:  # a port that nobody answers on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = evaluate("--policy", tiny_model, "--user-base-url", f"http://127.0.0.1:{port}/v1",
                   "--user-model-name", "u", "--out", str(out), timeout=60)
    assert res.returncode != 0 and "does not answer" in res.stderr
    res = evaluate("--policy", str(tmp_path), "--user-model", tiny_model, "--out", str(out))
    assert res.returncode != 0 and "not a model" in res.stderr
    res = evaluate("--policy", "oracle", "--user-model", tiny_model, "--out", str(out))
    assert res.returncode != 0 and "takes no user simulator" in res.stderr
    assert not out.exists()


def test_user_endpoint_that_stops_answering_fails_the_stage(tau2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    user = tau2.classes[2](tools=None, instructions="x", llm="openai/u",
                           llm_args={"api_base": f"http://127.0.0.1:{port}/v1", "api_key": "EMPTY", "num_retries": 0})
    greeting = tau2.msg.AssistantMessage(role="assistant", content="Hi! How can I help you today?")
    with pytest.raises(tau.RecordError, match="user simulator openai/u at http://127.0.0.1:[0-9]+/v1 failed"):
        user.generate_next_message(greeting, user.get_init_state())
