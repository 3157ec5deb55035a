"""An MCP server as an environment (common/envs/mcp/): real server processes over the SDK's stdio client.

The example (docs/examples/mcp_board) refused or accepted as it should, its oracle at 100, a constructed
episode per label, and hostile input: unlisted tools, schema breaks, text that is no call, servers that
crash, hang or write garbage, and Ctrl-C: each a labelled episode or a stage error, no hang, no stray process.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from common import envs, presets
from common.engine import calls as C
from common.engine import episode
from common.envs.mcp import server as S
from common.envs.mcp import verdict
from common.jsonl import RecordError
from common.presets import ROOT
from tests.helpers import Scripted

EXAMPLE = os.path.join(ROOT, "docs", "examples", "mcp_board")
SPEC = episode.PlaySpec(prompts="template", max_model_len=4096, max_new_tokens=200)

BAD_SERVER = '''
import os, time
from mcp.server.mcpserver import MCPServer
server = MCPServer("bad", log_level="WARNING")
count = [0]
@server.tool()
def bump() -> int:
    """Count one up."""
    count[0] += 1
    return count[0]
@server.tool()
def counter() -> int:
    """The count (read-only)."""
    return count[0]
@server.tool()
def crash() -> str:
    """Crash the server."""
    os._exit(3)
@server.tool()
def hang() -> str:
    """Never answer."""
    time.sleep(1000)
server.run()
'''


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def text(*calls):
    return C.format_calls(list(calls), "json")


def servers_in(folder):
    """Live processes whose command line runs a file of `folder` (a stray server would be one)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(folder in a for a in p.info["cmdline"] or []):
            found.append(p)
    return found


def write_env(folder, tasks, command=("python", "server.py"), state_tools=("board",), source=EXAMPLE, **more):
    os.makedirs(folder, exist_ok=True)
    if source:
        shutil.copy(os.path.join(source, "server.py"), folder)
    with open(os.path.join(folder, "env.json"), "w") as f:
        json.dump({"command": list(command), "state_tools": list(state_tools), **more}, f)
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        f.write("".join(t if isinstance(t, str) else json.dumps(t) + "\n" for t in tasks))
    return folder


@pytest.fixture(scope="module")
def board():
    return envs.load(f"mcp:{EXAMPLE}:train")


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bad_mcp"))
    with open(os.path.join(folder, "server.py"), "w") as f:
        f.write(BAD_SERVER)
    tasks = [{"id": name, "turns": [f"Please {name}."], "gold": [[call("bump")]]} for name in ("crash", "hang", "bump")]
    write_env(folder, tasks, state_tools=["counter"], source=None, timeout=1)
    return envs.load(f"mcp:{folder}:train")


def test_oracle_scores_100_on_train_and_test(board, tmp_path):
    scores = board.evaluate(str(tmp_path / "train"), "oracle", SPEC, None)
    assert scores["average"] == 100.0 and scores["mcp_board"] == 100.0
    test = envs.load(f"mcp:{EXAMPLE}:test")
    assert test.evaluate(str(tmp_path / "test"), "oracle", SPEC, None)["average"] == 100.0
    results = [json.loads(line) for line in open(tmp_path / "test" / "results.jsonl")]
    assert len(results) == 6 and all(r["valid"] for r in results)
    assert not servers_in(EXAMPLE)


def record(task, turns, stop="done", error=None):
    """A rollout record of per-turn model texts (json calls); diagnosis replays the calls itself."""
    steps = [[{"text": t, **dict(zip(("calls", "parse_error"), C.parse(t, "json"), strict=True))} for t in texts]
             for texts in turns]
    return {"task_id": task["id"], "category": task["category"], "sample_index": 0, "round": 0,
            "turns": [{"steps": s, "end": "answer"} for s in steps], "stop": stop} | ({"error": error} if error else {})


def test_each_label_from_a_constructed_episode(board):
    t = board.tasks
    add, assign = call("add_ticket", title="Broken search bar", priority="high"), call("assign_ticket", ticket_id="T-4",
                                                                                        assignee="chen")
    cases = [  # (task, per-turn texts, record's stop, expected labels, evidence expected in the labelled turn)
        ("board_add_assign", [[text(add), "T-4 is added."], [text(assign), "Done."]], None, ["pass", "pass"], ""),
        ("board_add_assign", [[text(call("add_ticket", title="Broken search bar", priority="urgent")), "T-4"],
                              [text(assign), "Done."]], None, ["invalid_tool_call", "state_mismatch"], "must be one of"),
        ("board_add_assign", [["<tool_call>\nnot json\n</tool_call>"], [text(assign), "Done."]], None,
         ["invalid_tool_call", "state_mismatch"], "unparsable"),
        ("board_add_assign", [[text(call("add_ticket", title="Broken search", priority="high")), "T-4"],
                              [text(assign), "Done."]], None, ["argument_mismatch", "state_mismatch"],
         "title='Broken search', ground truth 'Broken search bar'"),
        ("board_add_assign", [[text(add), "T-4"], [text(assign, call("move_ticket", ticket_id="T-4", status="doing")),
                                                   "Done."]], None, ["pass", "state_mismatch"],
         "state probe board differs from the gold replay: tickets[3].status='doing', gold 'todo'"),
        ("board_find_done", [[text(call("move_ticket", ticket_id="T-9", status="done")), "Sorry."]], None,
         ["recovery_failure", "missing_tool_call"], "ticket T-9 not found"),
        ("board_find_done", [["It is T-3."], [text(call("move_ticket", ticket_id="T-3", status="done")), "Done."]],
         None, ["missing_tool_call", "pass"], "no call in the turn"),
        ("board_find_done", [[text(call("find_tickets", query="SSL")), "Found it."],
                             [text(call("move_ticket", ticket_id="T-3", status="done")), "Done."]], None,
         ["response_mismatch", "pass"], "does not state 'T-3'"),
        ("board_no_delete", [["There is no tool to delete tickets."], [text(call("move_ticket", ticket_id="T-2",
                                                                                  status="done")), "Done."]],
         None, ["correct_abstention", "pass"], ""),
        ("board_no_delete", [[text(call("move_ticket", ticket_id="T-2", status="done")), "Done."]], "server_error",
         ["invalid_tool_call", "missing_tool_call"], "called move_ticket"),
    ]
    recs = [record(t[i], turns, stop or "done", "MCP server X failed" if stop else None) for i, turns, stop, _, _ in cases]
    with ThreadPoolExecutor(4) as pool:
        diags = list(pool.map(lambda r: board.diagnose(t[r["task_id"]], r), recs))
    for (_, _, _, labels, evidence), d in zip(cases, diags, strict=True):
        assert d["turn_labels"] == labels, d
        failing = next((e for z, e in zip(d["turn_labels"], d["evidence"], strict=True) if z == labels[0]), "")
        assert evidence in failing or evidence in " ".join(d["evidence"]), d
        assert d["reward"] == int(set(labels) <= {"pass", "correct_abstention"})
    assert diags[0]["official"] == {"valid": True, "error_type": None, "turn": None}
    assert diags[-1]["official"]["error_type"] == "mcp:server_error"
    assert "episode cut, the server failed: MCP server X failed" in diags[-1]["evidence"][1]
    with pytest.raises(RecordError, match="at most 2 turns"):
        board.diagnose(t["board_add_assign"], record(t["board_add_assign"], [["a"], ["b"], ["c"]]))


def test_session_answers_hostile_calls(board):
    task = board.tasks["board_add_assign"]
    session = board.session(task)
    try:
        assert [m["content"] for m in session.user_messages(1)] == ["Assign it to chen."]
        assert {"add_ticket", "board"} <= {t["name"] for t in session.tools} and session.start_turn(1) == []
        step = session.step(text(call("delete_everything")), "json")  # a tool the server does not list
        assert step["schema_errors"] == ["unknown tool delete_everything"]
        assert json.loads(step["call_errors"][0]) == {"error": "unknown tool delete_everything"}
        step = session.step(text(call("add_ticket", title=5, priority="urgent", extra=1)), "json")
        assert step["schema_errors"][0] == "add_ticket: unknown parameter extra"
        assert C.result_error(step["results"][0])  # the server refused it too: an error result
        step = session.step(text(call("move_ticket", ticket_id="T-1", status="doing")) + "\n" + "[not a call", "json")
        assert step["results"] == ["T-1 is now doing"] and step["call_errors"] == [None]
        step = session.step("import os; os.system('rm -rf /')", "json")  # text that is not a call is a message
        assert step["calls"] == [] and step["results"] == []
        step = session.step("<tool_call>\n{\"name\": \"board\"\n</tool_call>", "json")
        assert step["calls"] == [] and step["parse_error"]
    finally:
        session.close()
    assert not servers_in(EXAMPLE)


def test_refused_before_anything_plays(tmp_path):
    good = {"id": "a", "turns": ["Add it."], "gold": [[call("add_ticket", title="X", priority="low")]]}

    def refused(name, tasks, match, **env):
        folder = write_env(str(tmp_path / name), tasks, **env)
        with pytest.raises(RecordError, match=match):
            envs.load(f"mcp:{folder}:train")

    refused("json", [good, "{not json\n"], r"train.jsonl:2: not valid JSON")
    refused("turns", [good, {"id": "b", "turns": ["one", "two"], "gold": [[]]}], r"train.jsonl:2: gold must be a list of 2")
    refused("call", [{"id": "c", "turns": ["x"], "gold": [["add_ticket(title='X')"]]}], r"train.jsonl:1: gold turn 0")
    refused("dup", [good, good], r"train.jsonl:2: task id 'a' used twice")
    refused("cmd", [good], r"env.json: command must be", command=())
    with pytest.raises(RecordError, match="mcp:DIR:SPLIT"):
        envs.load(f"mcp:{tmp_path}")
    # these start the server
    refused("unknown", [good, {"id": "d", "turns": ["x"], "gold": [[call("archive", ticket_id="T-1")]]}],
            r"train.jsonl:2: gold turn 0: unknown tool archive \(the server lists list_team")
    refused("schema", [{"id": "e", "turns": ["x"], "gold": [[call("set_priority", ticket_id="T-1", priority="top")]]}],
            r"train.jsonl:1: gold turn 0: set_priority: parameter priority must be one of")
    refused("fails", [good, {"id": "f", "turns": ["x", "y"], "gold": [[], [call("move_ticket", ticket_id="T-9",
                                                                                status="done")]]}],
            r"train.jsonl:2: gold turn 1: move_ticket.* fails on a fresh server: .*ticket T-9 not found")
    refused("probe", [good], r"env.json: state tool 'snapshot' is not listed", state_tools=["snapshot"])
    refused("dead", [good], r"env.json: MCP server .* did not start: .*stderr: gone",
            command=["python", "-c", "import sys; print('gone', file=sys.stderr); sys.exit(3)"])
    assert not servers_in(str(tmp_path))


class ByTask(Scripted):
    """Writes, for a prompt, the text its task's script gives (the task named in the user's first message)."""

    def __init__(self, tokenizer, texts):
        super().__init__(tokenizer, self.write)
        self.texts, self.done = texts, set()

    def write(self, prompt_ids):
        prompt = self.tokenizer.decode(prompt_ids)
        name = next(n for n in self.texts if f"Please {n}." in prompt)
        if "<tool_response>" in prompt.rsplit("Please", 1)[-1]:
            return "Done."
        return self.texts[name]


def test_a_failing_server_cuts_its_episode_only(bad, tokenizer):
    engine = ByTask(tokenizer, {n: text(call(n)) for n in ("crash", "hang", "bump")})
    start = time.perf_counter()
    records, _ = bad.play(list(bad.tasks.values()), 1, engine, SPEC)
    assert time.perf_counter() - start < 120  # the hang waited its 1 s timeout, not for ever (loose: loaded CI)
    by_id = {r["task_id"]: r for r in records}
    assert by_id["bump"]["stop"] == "done" and "error" not in by_id["bump"]
    for name, why in (("crash", "closed the connection during tools/call crash"),
                      ("hang", "did not answer tools/call hang within 1 s")):
        r = by_id[name]
        assert r["stop"] == "server_error" and r["env"].startswith("mcp:") and why in r["error"], r
        assert "server_error" in envs.cut_stops(r, short_context=False)
        d = bad.diagnose(bad.tasks[name], r)
        assert d["reward"] == 0 and d["official"]["error_type"] == "mcp:server_error"
        assert d["turn_labels"] == ["missing_tool_call"] and "episode cut, the server failed" in d["evidence"][0]
    assert bad.diagnose(bad.tasks["bump"], by_id["bump"])["turn_labels"] == ["pass"]
    assert not servers_in(bad.spec["dir"])


def test_garbage_on_stdout_and_ctrl_c(bad, tmp_path):
    raw = ["python", "-c", "import sys, time; sys.stdin.readline(); print('hello', flush=True); time.sleep(60)"]
    start = time.perf_counter()
    with pytest.raises(S.ServerFault, match="answered initialize and tools/list outside the protocol"):
        S.Server(S.command_line(raw), str(tmp_path), 120)
    assert time.perf_counter() - start < 60  # at once, not after the 120 s timeout
    # Ctrl-C while a call waits on a server that never answers: the stage exits, the server with it
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from common.envs.mcp import server as S
        server = S.Server(S.command_line(["python", "server.py"]), {bad.spec["dir"]!r}, 60)
        print("ready", flush=True)
        server.call("hang", {{}})
    """)
    stage = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert stage.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    assert servers_in(bad.spec["dir"])
    stage.send_signal(signal.SIGINT)
    assert stage.wait(timeout=20) != 0
    deadline = time.time() + 5
    while servers_in(bad.spec["dir"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not servers_in(bad.spec["dir"])


def test_views_and_preset_without_a_server():
    kind = envs.kind_of(f"mcp:{EXAMPLE}")
    assert kind is envs.KINDS["mcp"] and kind.CHECKS_TURNS
    assert kind.columns(f"mcp:{EXAMPLE}") == ["mcp_board"] and kind.eval_tasks("mcp:x") == "mcp:x:test"
    tasks = kind.view_tasks(f"mcp:{EXAMPLE}:test")
    view = kind.task_view(tasks["board_t_add_assign"])
    assert view["questions"][1] == [{"role": "user", "content": "Assign it to ana."}]
    assert view["ground_truth"][1] == ["[assign_ticket(ticket_id='T-4', assignee='ana')]"]
    assert verdict.first_diff({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == "a[1].b=2, gold 3"
    p = presets.resolve("tiny", ["ENV=mcp:docs/examples/mcp_board"])
    assert (p.tasks, p.train_limit) == ("mcp:docs/examples/mcp_board:train", "8")
    assert presets.folders(p.env)[0] == "-docs-examples-mcp_board"
    with pytest.raises(presets.PresetError, match="env.json"):
        presets.resolve("tiny", ["ENV=mcp:docs/examples"])
