"""τ²-bench through evaluate.py --tasks tau2[:DOMAIN...], on τ²'s own orchestrator and evaluator.

The oracle (gold actions replayed as model text, gold user actions by a scripted user)
must score 100 and a lazy oracle must not; the tiny model plays one task per domain as
the agent against itself served by vLLM's OpenAI server as the user simulator. The
contract is asserted (records, the simulator named, rewards in [0, 1], no server left
running), never what the tiny model says.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from common.envs.tau2 import tau2 as tau
from common.envs.tau2 import tau2 as tau2_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {"domain", "task_id", "reward", "termination", "error", "reward_info", "agent_steps", "transcript"}


def evaluate(*args, timeout=600):  # τ²-bench's three domains unless --tasks names others
    tasks = () if "--tasks" in args else ("--tasks", "tau2")
    return subprocess.run([sys.executable, "evaluate.py", *tasks, *args], cwd=ROOT, capture_output=True,
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
    """Two episodes at once (their agent outputs batched), rows still in domain order. The
    agent plays on the session's server; the user simulator's server is the stage's own,
    started and stopped by it. Telecom's user acts through tool calls, which the tiny model
    does not write: served as the user there, it is refused before any episode, naming
    --user-tool-parser, and its server is stopped."""
    import re
    out = tmp_path / "tiny"
    args = ["--policy", tiny_model, "--server", tiny_server, "--user-model", tiny_model, "--limit", "1",
            "--engine", "vllm", "--max-new-tokens", "24", "--user-max-tokens", "24", "--max-episode-steps", "4",
            "--max-model-len", "16384", "--out", str(out)]
    res = evaluate(*args, "--tasks", "tau2:telecom", timeout=900)
    assert res.returncode == 1 and "answers a tool offer with text, not a tool call" in res.stderr, res.stderr[-4000:]
    assert "--user-tool-parser (USER_TOOL_PARSER)" in res.stderr and "--tool-call-parser hermes" in res.stderr
    assert "Traceback" not in res.stderr and not (out / "results.jsonl").exists() and not (out / "scores.json").exists()
    port = int(re.search(r"at http://127\.0\.0\.1:(\d+)/v1 answers", res.stderr).group(1))
    assert not _servers(tiny_model, port)
    t0 = time.perf_counter()
    res = evaluate(*args, "--tasks", "tau2:retail,airline", "--concurrency", "2", timeout=900)
    seconds = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    rows, scores = read_out(out)
    port = urllib.parse.urlparse(scores["user_simulator"]["base_url"]).port
    assert not _servers(tiny_model, port)  # the server evaluate.py started is gone
    assert [r["domain"] for r in rows] == ["retail", "airline"]
    for r in rows:
        assert ROW_KEYS <= set(r) and 0.0 <= r["reward"] <= 1.0
        assert r["agent_steps"] and r["tokens"]["generations"] == len(r["agent_steps"])
        assert r["transcript"][0]["role"] == "assistant" and any(m["role"] == "user" for m in r["transcript"])
    sim = scores["user_simulator"]
    assert sim["model"] == os.path.abspath(tiny_model) and sim["base_url"].startswith("http://127.0.0.1:")
    assert sim["kind"].startswith("vllm")
    assert sim["llm_args"]["temperature"] == 0.0 and sim["llm_args"]["max_tokens"] == 24
    assert all(0.0 <= scores[d] <= 100.0 for d in ("retail", "airline", "average"))
    assert f"user simulator: {os.path.abspath(tiny_model)} at http://127.0.0.1:" in res.stdout
    print(f"tiny agent vs tiny user, 1 task per domain: {seconds:.0f} s, scores {scores}")


def test_trials_give_taus_pass_k(tmp_path):
    """--trials K plays every task K times, trial k with the seed τ²'s own runner gives it
    (random.seed(300), one randint per trial), and scores.json adds pass^1..pass^K from τ²'s
    pass_hat_k; a task solved in 2 of 3 trials counts 2/3 at pass^1, 1/3 at pass^2, 0 at pass^3."""
    import random
    out = tmp_path / "oracle"
    res = evaluate("--policy", "oracle", "--tasks", "tau2:airline", "--limit", "2", "--trials", "2", "--out", str(out))
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
    assert res.returncode != 0 and "need one user simulator" in res.stderr
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


# ----------------------------------------------------------------------------- user endpoints that fail


class FakeUser:
    """A local OpenAI-compatible endpoint (a real HTTP server in a thread) serving the model "u":
    /v1/models lists it; /v1/chat/completions answers as `mode` says: "text" (a user's message, or
    ###STOP### once the agent has spoken, whatever tools it is offered), "429" or "500" (an OpenAI
    error body), "hang" (holds the request, never answering). `chats`: when each chat request came."""

    def __init__(self, mode):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake, self.mode, self.chats, self.release = self, mode, [], threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") != "/v1/models":
                    return self.reply(404, {"error": {"message": "no such route"}})
                self.reply(200, {"object": "list", "data": [{"id": "u", "object": "model"}]})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.chats.append((time.time(), request))
                if fake.mode == "hang":
                    fake.release.wait()
                    return
                if fake.mode in ("429", "500"):
                    return self.reply(int(fake.mode), {"error": {"message": f"fake {fake.mode}", "type": "x"}})
                spoke = sum(m["role"] == "user" for m in request["messages"]) > 1  # the agent's turns, flipped
                self.reply(200, {"id": "c", "object": "chat.completion", "created": 0, "model": "u", "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": "###STOP###" if spoke else "I want to cancel my booking."}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class SilentSocket:
    """A socket that accepts connections and never answers (it reads nothing, writes nothing)."""

    def __init__(self):
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url, self.accepted, self.held = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1", [], []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.accepted.append(time.time())
                self.held.append(conn)

    def close(self):
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.fixture
def fake_user(request):
    made = []

    def start(mode):
        made.append(SilentSocket() if mode == "silent" else FakeUser(mode))
        return made[-1]
    yield start
    for f in made:
        f.close()


def rollout(*args):
    return subprocess.run([sys.executable, "rollout.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def rollout_args(model, tasks, url, out):
    return ["--model", model, "--tasks", tasks, "--limit", "1", "--n", "1", "--engine", "hf",
            "--max-new-tokens", "16", "--max-episode-steps", "4", "--user-base-url", url, "--user-model-name", "u",
            "--out", str(out), "--summary", str(out.with_suffix(".summary.json"))]


def timed(argv):
    """A stage run as rollout() and evaluate() run it, and when its "error: ..." line came (None if
    none): when the stage stopped, before the interpreter's own teardown (seconds of it with torch)."""
    import threading
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    stdout = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()
    lines, error_at = [], None
    for line in proc.stderr:
        lines.append(line)
        if error_at is None and line.startswith("error: "):
            error_at = time.time()
    proc.wait(timeout=600)
    reader.join()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout[0], "".join(lines)), error_at


def stopped(res, *, says):
    """The stage stopped with its own one-line error (no traceback) saying `says`."""
    assert res.returncode == 1, res.stderr[-3000:]
    assert says in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


TIMEOUT = 3  # --user-timeout of the tests: seconds


def test_a_user_endpoint_that_never_answers_stops_the_stage(tmp_path, tiny_model, fake_user):
    """A socket that accepts and never answers, and an endpoint that lists its model but holds every
    chat request: rollout.py and evaluate.py stop within two timeouts of the first request
    (their error line; the interpreter's teardown follows), naming the endpoint, exit 1, no output."""
    silent = fake_user("silent")
    out = tmp_path / "r.jsonl"
    res, done = timed(["rollout.py", *rollout_args(tiny_model, "tau2:airline:train", silent.url, out),
                       "--user-timeout", str(TIMEOUT)])
    stopped(res, says=f"user simulator at {silent.url} does not answer within {TIMEOUT} s")
    assert silent.accepted and done - silent.accepted[0] < 2 * TIMEOUT
    assert not list(tmp_path.iterdir())

    holding = fake_user("hang")
    res, done = timed(["evaluate.py", "--policy", tiny_model, "--engine", "hf", "--tasks", "tau2:airline",
                       "--limit", "1", "--max-new-tokens", "16", "--max-episode-steps", "4", "--user-base-url",
                       holding.url, "--user-model-name", "u", "--user-timeout", str(TIMEOUT),
                       "--out", str(tmp_path / "ood")])
    stopped(res, says=f"user simulator openai/u at {holding.url} did not answer within {TIMEOUT} s (--user-timeout")
    assert len(holding.chats) == 1 and done - holding.chats[0][0] < 2 * TIMEOUT  # a timed-out request: no retry
    assert not list(tmp_path.iterdir())


def test_a_user_endpoint_that_errs_stops_the_stage_after_bounded_retries(tmp_path, tiny_model, fake_user):
    from common.envs.tau2 import tau2 as T
    status = "500"
    failing = fake_user(status)
    out = tmp_path / "r.jsonl"
    res = rollout(*rollout_args(tiny_model, "tau2:airline:train", failing.url, out), "--user-timeout", str(TIMEOUT))
    stopped(res, says=f"user simulator openai/u at {failing.url} failed after {T.USER_RETRIES + 1} tries: ")
    assert f"fake {status}" in res.stderr and len(failing.chats) == T.USER_RETRIES + 1
    assert not list(tmp_path.iterdir())


def test_a_rate_limited_request_is_tried_again_then_stops(fake_user):
    """A 429 is retried as a 5xx is (end to end above): USER_RETRIES more tries, then the stage's error."""
    import urllib.error
    import urllib.request

    from common.envs.tau2 import tau2 as T
    limited = fake_user("429")

    def ask():
        request = urllib.request.Request(limited.url + "/chat/completions", data=b'{"messages": []}',
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=TIMEOUT)
    with pytest.raises(T.RecordError, match=f"sim failed after {T.USER_RETRIES + 1} tries: HTTP 429"):
        T.retried(ask, "sim", TIMEOUT, urllib.error.URLError)
    assert len(limited.chats) == T.USER_RETRIES + 1


def test_a_user_endpoint_that_answers_tool_offers_with_text(tmp_path, tiny_model, fake_user):
    """Refused on telecom, whose user acts through tool calls, before any episode (one chat request:
    the check's, offering telecom's user tools), naming the flag its server needs; airline and
    retail, whose users have no tools, play against it."""
    texting = fake_user("text")
    out = tmp_path / "r.jsonl"
    res = rollout(*rollout_args(tiny_model, "tau2:telecom:train", texting.url, out))
    stopped(res, says=f"user simulator u at {texting.url} answers a tool offer with text, not a tool call")
    assert "--enable-auto-tool-choice" in res.stderr and "telecom" in res.stderr
    (_, check), = texting.chats
    assert check["tool_choice"] == "auto" and {t["function"]["name"] for t in check["tools"]} >= {"check_status_bar"}
    res = evaluate("--policy", tiny_model, "--engine", "hf", "--tasks", "tau2:telecom", "--limit", "1",
                   "--user-base-url", texting.url, "--user-model-name", "u", "--out", str(tmp_path / "ood"))
    stopped(res, says="answers a tool offer with text, not a tool call")
    assert "--enable-auto-tool-choice" in res.stderr and len(texting.chats) == 2
    assert not list(tmp_path.iterdir())

    res = rollout(*rollout_args(tiny_model, "tau2:airline:train", texting.url, out))
    assert res.returncode == 0, res.stderr[-3000:]
    record, = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["user_simulator"] == f"u at {texting.url}" and record["turns"][0]["user"] == \
        "I want to cancel my booking."
    res = evaluate("--policy", tiny_model, "--engine", "hf", "--tasks", "tau2:retail", "--limit", "1",
                   "--max-new-tokens", "16", "--max-episode-steps", "4", "--user-base-url", texting.url,
                   "--user-model-name", "u", "--out", str(tmp_path / "ood"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows, scores = read_out(tmp_path / "ood")
    assert [r["domain"] for r in rows] == ["retail"] and scores["user_simulator"]["llm_args"]["timeout"] == 180
    assert not any("tools" in request for _, request in texting.chats[2:])  # no user tools offered there
