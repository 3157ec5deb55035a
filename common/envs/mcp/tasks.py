"""An MCP environment's folder: env.json (how its server starts over stdio, which tools are state
probes) and its task files SPLIT.jsonl, refused before anything plays where they cannot be played:
a malformed task, a gold call of a tool the server does not list or that breaks its inputSchema,
a gold call that fails on a fresh server, a server that does not start or list its tools.
Formats: docs/environments.md, MCP servers.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

from common.envs.mcp import server as S
from common.jsonl import RecordError, read_json, read_jsonl

TIMEOUT = 30.0  # seconds a server may take to start or to answer one request (env.json "timeout")


def read_spec(folder):
    """env.json of `folder`: {"command", "state_tools", "timeout", "system"} with the folder as "dir"."""
    path = os.path.join(folder, "env.json")
    if not os.path.isdir(folder):
        raise RecordError(f"{folder}: no such folder (ENV=mcp:DIR names a folder holding env.json)")
    spec = read_json(path)
    if not isinstance(spec, dict):
        raise RecordError(f"{path}: expected a JSON object")
    unknown = sorted(set(spec) - {"command", "state_tools", "timeout", "system"})
    if unknown:
        raise RecordError(f"{path}: unknown field {unknown[0]!r} (command, state_tools, timeout, system)")
    command = spec.get("command")
    if not (isinstance(command, str) and command.strip() or isinstance(command, list) and command
            and all(isinstance(a, str) and a for a in command)):
        raise RecordError(f"{path}: command must be the server's command line, a string or a list of strings, "
                          'e.g. ["python", "server.py"] (run in the folder)')
    probes = spec.get("state_tools")
    if not (isinstance(probes, list) and all(isinstance(p, str) for p in probes)):
        raise RecordError(f"{path}: state_tools must be a list of the read-only tools that show the state, "
                          'e.g. ["board"] ([] for none)')
    timeout = spec.get("timeout", TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise RecordError(f"{path}: timeout must be a number of seconds above 0")
    if not isinstance(spec.get("system", ""), str):
        raise RecordError(f"{path}: system must be a string (the system prompt)")
    return {"dir": os.path.abspath(folder), "command": S.command_line(command), "state_tools": probes,
            "timeout": float(timeout), "system": spec.get("system") or None}


def start(spec):
    return S.Server(spec["command"], spec["dir"], spec["timeout"])


def read_tasks(path, category):
    """The tasks of a task file by id, in file order, checked for shape (no server needed)."""
    tasks = {}
    for rec in read_jsonl(path, required=["id", "turns", "gold"]):
        where = f"{path}:{rec.pop('_line')}"
        problem = _shape(rec)
        if problem:
            raise RecordError(f"{where}: {problem}")
        if rec["id"] in tasks:
            raise RecordError(f"{where}: task id {rec['id']!r} used twice")
        n = len(rec["turns"])
        tasks[rec["id"]] = {"id": rec["id"], "category": rec.get("category") or category, "turns": rec["turns"],
                            "gold": rec["gold"], "response": rec.get("response") or [[] for _ in range(n)],
                            "where": where}
    if not tasks:
        raise RecordError(f"{path}: no tasks")
    return tasks


def _shape(rec):
    """What is wrong with a task record's shape, or None."""
    unknown = sorted(set(rec) - {"id", "category", "turns", "gold", "response"})
    if unknown:
        return f"unknown field {unknown[0]!r} (id, category, turns, gold, response)"
    if not isinstance(rec["id"], str) or not rec["id"] or ":" in rec["id"]:
        return "id must be a non-empty string without ':'"
    if not isinstance(rec.get("category", ""), str):
        return "category must be a string"
    turns = rec["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        return "turns must be a non-empty list of the user's messages (strings), one per turn"
    gold = rec["gold"]
    if not isinstance(gold, list) or len(gold) != len(turns):
        return f"gold must be a list of {len(turns)} turns (one per user message), each a list of calls"
    for k, calls in enumerate(gold):
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and set(c) == {"name", "arguments"} and isinstance(c["name"], str)
                and isinstance(c["arguments"], dict) for c in calls):
            return f'gold turn {k}: a list of calls {{"name": TOOL, "arguments": {{...}}}} ([] where no call is due)'
    response = rec.get("response")
    if response is not None and not (isinstance(response, list) and len(response) == len(turns) and all(
            isinstance(r, list) and all(isinstance(f, str) and f.strip() for f in r) for r in response)):
        return f"response must be a list of {len(turns)} lists of facts (strings) the turn's answer must state"
    return None


def check(spec, tasks, tools):
    """Refuse gold calls that name a tool the server does not list or break its inputSchema, and
    state probes it does not list, naming the file, line and what to fix."""
    names = [t["name"] for t in tools]
    env_json = os.path.join(spec["dir"], "env.json")
    if not tools:
        raise RecordError(f"{env_json}: the server lists no tools")
    for probe in spec["state_tools"]:
        if probe not in names:
            raise RecordError(f"{env_json}: state tool {probe!r} is not listed by the server (it lists "
                              f"{', '.join(names)})")
        schema = next(t for t in tools if t["name"] == probe)["parameters"]
        if schema.get("required"):
            raise RecordError(f"{env_json}: state tool {probe!r} must take no required arguments")
    for task in tasks.values():
        for k, calls in enumerate(task["gold"]):
            for call in calls:
                reason = S.schema_error(call, tools)
                if reason:
                    raise RecordError(f"{task['where']}: gold turn {k}: {reason} (the server lists "
                                      f"{', '.join(names)})")


def check_gold(spec, tasks, replay, workers=8):
    """Every task's gold replayed on its own fresh server (`replay(spec, task)`, several at
    once): {task id: the replay}; a gold call that fails is refused, naming the task's line."""
    def one(task):
        try:
            return replay(spec, task)
        except S.ServerFault as e:
            raise RecordError(f"{task['where']}: replaying the gold calls: {e}") from None
    with ThreadPoolExecutor(max(1, min(workers, len(tasks)))) as pool:
        replays = dict(zip(tasks, pool.map(one, tasks.values()), strict=True))
    for task_id, turns in replays.items():
        for k, turn in enumerate(turns):
            for call, result, error in zip(tasks[task_id]["gold"][k], turn["results"], turn["errors"], strict=True):
                if error:
                    raise RecordError(f"{tasks[task_id]['where']}: gold turn {k}: {call['name']}"
                                      f"({json.dumps(call['arguments'])}) fails on a fresh server: {result[:200]}")
    return replays
