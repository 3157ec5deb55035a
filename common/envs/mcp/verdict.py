"""The verdict on an MCP episode, BFCL's rules on MCP evidence (docs/environments.md, MCP servers): the
model's calls replayed on a fresh server, the gold calls on another; after every turn the state
probes' outputs compared (state check), the turn's gold results looked for among the model's
results so far (BFCL's response check) and its response facts in the turn's answer. Reward 1
when every turn passes; one label per turn by common/seal/taxonomy.py's rules and priority, the
state, recovery, missing and response rules read from this evidence.
"""

import collections
import json
from dataclasses import dataclass, field

from common.engine import calls as C
from common.envs.mcp import server as S
from common.jsonl import RecordError
from common.seal import taxonomy as T


def run_turns(spec, turns):
    """Play per-turn call lists in order on one fresh server: ([per turn {"results", "errors",
    "state": {probe: output}}], fault), fault None or (turn, ServerFault message)."""
    done = []
    try:
        with S.Server(spec["command"], spec["dir"], spec["timeout"]) as server:
            for calls in turns:
                ran = [S.run_call(server, server.tools, c) for c in calls]
                state = {p: server.call(p, {})[0] for p in spec["state_tools"]}
                done.append({"results": [r for r, _ in ran], "errors": [e for _, e in ran], "state": state})
    except S.ServerFault as e:
        return done, (len(done), str(e))
    return done, None


def gold_replay(spec, task):
    """The gold calls' replay of a task; ServerFault if the server fails on them."""
    done, fault = run_turns(spec, task["gold"])
    if fault:
        raise S.ServerFault(fault[1])
    return done


@dataclass
class Turn:
    """The evidence of one user turn, with the fields common/seal/taxonomy.py's rules read."""

    index: int
    gt: list  # the gold calls
    tools: list
    played: bool = True
    parse_errors: list = field(default_factory=list)
    schema_errors: list = field(default_factory=list)  # (call, reason)
    calls: list = field(default_factory=list)
    results: list = field(default_factory=list)  # replayed, per call
    errors: list = field(default_factory=list)  # per call: the server's isError (or a refusal)
    answer: str = ""  # the turn's closing message (its last output, when that made no call)
    state: dict | None = None  # {"valid", "probe", "diff"}; None: not checked
    response: dict | None = None  # {"valid", "missing", "unstated"}
    fault: str | None = None  # the server failed here (in the rollout or the replay)


def read_turns(task, record, tools):
    """One Turn per task turn from a rollout record's turns (records are not trusted: the calls and
    parse errors are read, the schema verdicts re-derived); RecordError on another structure."""
    rollout = record.get("turns")
    if not isinstance(rollout, list) or len(rollout) > len(task["turns"]):
        raise RecordError(f"turns must be a list of at most {len(task['turns'])} turns (the task's)")
    turns = []
    for k, gold in enumerate(task["gold"]):
        turn = Turn(k, gold, tools, played=k < len(rollout))
        if turn.played:
            steps = rollout[k].get("steps") if isinstance(rollout[k], dict) else None
            if not isinstance(steps, list):
                raise RecordError(f"turn {k}: expected an object with a 'steps' list")
            for s, step in enumerate(steps):
                if not (isinstance(step, dict) and isinstance(step.get("calls"), list)
                        and isinstance(step.get("parse_error", ""), (str, type(None)))
                        and isinstance(step.get("text", ""), str)):
                    raise RecordError(f"turn {k} step {s}: expected 'text', 'calls' and 'parse_error'")
                for call in step["calls"]:
                    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                            and isinstance(call.get("arguments"), dict)):
                        raise RecordError(f"turn {k} step {s}: a call is an object with a 'name' and 'arguments'")
                    call = {"name": call["name"], "arguments": call["arguments"]}
                    turn.calls.append(call)
                    if reason := S.schema_error(call, tools):
                        turn.schema_errors.append((call, reason))
                if step.get("parse_error"):
                    turn.parse_errors.append(step["parse_error"])
            if steps and not steps[-1]["calls"] and not steps[-1].get("parse_error"):
                turn.answer = steps[-1].get("text", "").split("</think>")[-1]
        turns.append(turn)
    if record.get("stop") == "server_error":  # the server failed in the rollout's last turn: it and those after
        for t in turns[max(len(rollout) - 1, 0):]:
            t.fault = str(record.get("error") or "the server failed")
    return turns


def check(task, turns, gold, replay):
    """Replay the model's calls (`replay(per-turn calls)`: run_turns) and fill each played turn's
    results, state and response checks against the gold replay `gold`; returns the verdict
    {"valid", "error_type", "turn"}."""
    played = [t for t in turns if t.played]
    done, fault = replay([t.calls for t in played])
    if fault:
        for t in turns[fault[0]:]:
            t.fault = t.fault or fault[1]
    model_results = []  # every result so far: BFCL's response check reads them all
    for turn, ran, want in zip(played, done, gold, strict=False):
        turn.results, turn.errors = ran["results"], ran["errors"]
        model_results += ran["results"]
        turn.state = state_check(ran["state"], want["state"])
        missing = list((collections.Counter(want["results"]) - collections.Counter(model_results)).elements())
        unstated = [f for f in task["response"][turn.index] if f.lower() not in turn.answer.lower()]
        turn.response = {"valid": not missing and not unstated, "missing": missing, "unstated": unstated}
    for turn in turns:
        if turn.fault:
            return {"valid": False, "error_type": "mcp:server_error", "turn": turn.index}
        if not turn.played:
            return {"valid": False, "error_type": "mcp:force_terminated", "turn": turn.index}
        error = ("mcp:empty_turn" if turn.gt and not turn.calls else
                 "mcp:state_mismatch" if not turn.state["valid"] else
                 "mcp:response_mismatch" if turn.gt and turn.response["missing"] else
                 "mcp:answer_mismatch" if turn.response["unstated"] else None)
        if error:
            return {"valid": False, "error_type": error, "turn": turn.index}
    return {"valid": True, "error_type": None, "turn": None}


def state_check(made, want):
    """The probes' outputs after the model's turn against the gold replay's: the first probe that
    differs and its first differing item."""
    for probe, gold in want.items():
        if made.get(probe) != gold:
            return {"valid": False, "probe": probe, "diff": first_diff(_json(made.get(probe)), _json(gold))}
    return {"valid": True, "probe": None, "diff": None}


def _json(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def first_diff(a, b, path=""):
    """Where `a` first differs from the gold `b`, as one short phrase."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*b, *(k for k in a if k not in b)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return f"{where} {'missing' if key not in a else 'not in gold'}"
            if a[key] != b[key]:
                return first_diff(a[key], b[key], where)
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return first_diff(x, y, f"{path}[{i}]")
        return f"{path or 'output'}: {len(a)} items, gold {len(b)}"
    if isinstance(a, str) and isinstance(b, str) and "\n" in a + b:
        la, lb = a.splitlines(), b.splitlines()
        i = next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), min(len(la), len(lb)))
        return f"line {i + 1}: {la[i] if i < len(la) else '(end)'!r}, gold {lb[i] if i < len(lb) else '(end)'!r}"
    return f"{path or 'output'}={a!r}, gold {b!r}"


# ----------------------------------------------------------------------------- Ψ's rules on this evidence


def abstention(turn):
    """No gold call (the agent should not act): `correct_abstention` if the model made no call and
    its answer states the turn's facts; any call is an `invalid_tool_call`."""
    if turn.calls:
        return "invalid_tool_call", f"called {T.show(turn.calls[0])} on an abstention turn"
    if turn.played and turn.response and turn.response["unstated"]:
        return "response_mismatch", f"the answer does not state {turn.response['unstated'][0]!r}"
    return "correct_abstention", "no call on an abstention turn" if turn.played else "not played (trajectory stopped)"


def passes(turn):
    """Gold calls due: the model made a call and the state and response checks hold after the turn
    (bad outputs before it do not matter: the turn recovered)."""
    if turn.calls and not turn.fault and turn.state and turn.state["valid"] and turn.response["valid"]:
        bad = len(turn.parse_errors) + len(turn.schema_errors)
        return f"state and response match ({len(turn.calls)} call(s){f', after {bad} bad output(s)' if bad else ''})"
    return None


def argument_mismatch(turn):
    """BFCL's rule: for a tool the gold calls, some gold argument set was never used in the turn
    and some model call of it has the values of no gold call (whole argument sets, both completed
    with the inputSchema's defaults, matched by value)."""
    made, wanted = {}, {}
    for calls, into in ((turn.calls, made), (turn.gt, wanted)):
        for call in calls:
            into.setdefault(call["name"], []).append(_args(call, turn.tools))
    for name, gold in wanted.items():
        unmatched = [a for a in made.get(name, []) if a not in gold]
        want = next((a for a in gold if a not in made.get(name, [])), None)
        if want is not None and unmatched:
            closest = max(unmatched, key=lambda a: sum(k in a and a[k] == v for k, v in want.items()))
            return f"{name}: {T.arg_diff(closest, want)}"
    return None


def state_mismatch(turn):
    """The model made calls in the turn and a state probe's output differs from the gold replay's
    after it (state is cumulative: an earlier turn's difference counts here too)."""
    if turn.calls and turn.state and not turn.state["valid"]:
        return f"state probe {turn.state['probe']} differs from the gold replay: {turn.state['diff']}"
    return None


def recovery_failure(turn):
    """The turn's last call failed (the server's isError, or a call of an unlisted tool) and
    nothing corrected it in the turn."""
    if turn.errors and turn.errors[-1]:
        return f"last call failed: {T.show(turn.calls[-1])} -> {turn.results[-1]}"
    return None


def missing_tool_call(turn):
    """The server failed in the turn (the episode was cut there: the environment's fault), or no
    call in the turn (a turn never played included), or a gold tool never called."""
    if turn.fault:
        return f"episode cut, the server failed: {turn.fault}"
    if not turn.played:
        return "not played (trajectory stopped)"
    if not turn.calls:
        return "no call in the turn"
    missing = sorted({c["name"] for c in turn.gt} - {c["name"] for c in turn.calls})
    return f"never called {', '.join(missing)}" if missing else None


def response_mismatch(turn):
    """A gold result of the turn is not among the model's results so far (BFCL's response
    check), or a fact the turn's answer must state is not in it."""
    if turn.calls and turn.response and not turn.response["valid"]:
        if turn.response["missing"]:
            return f"{len(turn.response['missing'])} gold result(s) missing, e.g. {turn.response['missing'][0]!r}"
        return f"the answer does not state {turn.response['unstated'][0]!r}"
    return None


FAILURE_RULES = {"invalid_tool_call": T.invalid_tool_call, "argument_mismatch": argument_mismatch,
                 "state_mismatch": state_mismatch, "recovery_failure": recovery_failure,
                 "missing_tool_call": missing_tool_call, "response_mismatch": response_mismatch}


def label_turn(turn):
    """(label, evidence) of one turn: abstention, pass, or the first failure rule in Ψ's priority."""
    if not turn.gt:
        label, evidence = abstention(turn)
        return label, T.line(evidence)
    if evidence := passes(turn):
        return "pass", T.line(evidence)
    return T.label(turn, FAILURE_RULES)


def _args(call, tools):
    """A call's arguments completed with its inputSchema's defaults."""
    schema = next((t["parameters"] for t in tools if t["name"] == call["name"]), {})
    return {k: p["default"] for k, p in schema.get("properties", {}).items() if "default" in p} | call["arguments"]


def diagnose(tools, task, record, gold, replay):
    """The diagnosis record (docs/design.md §3) of one rollout record of `task` (check's arguments)."""
    turns = read_turns(task, record, tools)
    official = check(task, turns, gold, replay)
    labelled = [label_turn(t) for t in turns]
    labels = [z for z, _ in labelled]
    return {"task_id": task["id"], "category": task["category"], "sample_index": record.get("sample_index", 0),
            "round": record.get("round", 0), "reward": int(official["valid"]), "official": official,
            "turn_labels": labels, "evidence": [e for _, e in labelled], "profile": T.profile(labels)}


def oracle_texts(task, fmt, gold=None, facts=True):
    """Per turn, the outputs of a model that makes the calls `gold` (default: the task's) in `fmt` and closes
    each turn with an answer stating its facts (with `facts`)."""
    return [([C.format_calls(calls, fmt)] if calls else []) + [(facts and " ".join(task["response"][k])) or "Done."]
            for k, calls in enumerate(gold or task["gold"])]
