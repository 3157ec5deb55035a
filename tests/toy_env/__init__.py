"""A third environment, written only against docs/environments.md's interface: a key-value store.

Four tools act on a dict; each task scripts its user turns and the gold calls of each; an episode's reward is 1
when the store ends as the gold calls leave it. tests/test_third_env.py copies this folder to common/envs/toy/,
adds its line to KINDS and runs `bash loop.sh tiny --set ENV=toy`: no stage, loop.sh, preset or view changes.
Standard library at import (the presets read the registry before setup.sh).
"""

import copy
import json
import os
import types

from common.engine import session

TOOLS = [
    {"name": "put", "description": "Store a value under a key.",
     "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "value": {"type": "string"}},
                    "required": ["key", "value"]}},
    {"name": "get", "description": "The value stored under a key.",
     "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
    {"name": "remove", "description": "Remove a key and its value.",
     "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
    {"name": "keys", "description": "Every key stored.", "parameters": {"type": "object", "properties": {}}},
]
CATEGORIES = ["store", "erase"]
DONE = "Done."


def _task(i, category, state, turns):
    return {"id": f"{category}_{i}", "category": category, "state": state,
            "turns": [t for t, _ in turns], "gold": [[{"name": n, "arguments": a} for n, a in calls] for _, calls in turns]}


SPLITS = {
    "train": [_task(i, "store", {}, [(f"{k.title()} is {v}: remember it.", [("put", {"key": k, "value": v})])])
              for i, (k, v) in enumerate([("color", "blue"), ("city", "Paris"), ("pet", "cat"), ("fruit", "plum")])]
    + [_task(i, "erase", {k: "x", "other": "y"}, [(f"{k.title()}: forget it.", [("remove", {"key": k})])])
       for i, k in enumerate(["color", "city", "pet", "fruit"])],
    "test": [_task(9, "store", {}, [("Car is red: remember it.", [("put", {"key": "car", "value": "red"})]),
                                    ("Tea is green: remember it too.", [("put", {"key": "tea", "value": "green"})])]),
             _task(9, "erase", {"tea": "x"}, [("Tea: forget it.", [("remove", {"key": "tea"})])])],
}


def run_call(state, call):
    """(result text, error or None) of one call on `state` (changed in place)."""
    name, key = call["name"], str(call["arguments"].get("key"))
    if name == "put":
        state[key] = str(call["arguments"]["value"])
        return "ok", None
    if name in ("get", "remove") and key not in state:
        return json.dumps({"error": f"no key {key}"}), f"no key {key}"
    if name == "get":
        return state[key], None
    if name == "remove":
        del state[key]
        return "ok", None
    return json.dumps(sorted(state)), None


# Ψ's rules on this evidence (the turn, its calls, the store after it, the gold calls' store): a failing turn
# that made calls left the store otherwise than the gold calls; one that made none missed them.
def invalid_tool_call(turn, *_):
    from common.seal import taxonomy
    return taxonomy.invalid_tool_call(turn)


def state_mismatch(turn, calls, made, gold):
    return f"store {made}, gold {gold}" if calls else None


def missing_tool_call(turn, calls, *_):
    return None if calls else "no call in the turn"


def never(*_):
    return None


RULES = {"invalid_tool_call": invalid_tool_call, "argument_mismatch": never, "state_mismatch": state_mismatch,
         "recovery_failure": never, "missing_tool_call": missing_tool_call, "response_mismatch": never}


class Session(session.Session):
    """One episode (common/engine/session.py): the store, and each call run on it."""

    tools = TOOLS

    def __init__(self, task):
        super().__init__(task)
        self.state = copy.deepcopy(task["state"])

    def step(self, text, fmt):
        from common.engine import calls as C
        calls, parse_error = C.parse(text, fmt)
        schema = [C.validate(c, TOOLS) for c in calls]
        ran = [run_call(self.state, c) if s is None else (json.dumps({"error": s}), s) for c, s in zip(calls, schema, strict=True)]
        return {"calls": calls, "parse_error": parse_error, "results": [r for r, _ in ran],
                "call_errors": [e for _, e in ran], "schema_errors": schema}


class Toy:
    """The key-value store: `toy:SPLIT` (ENV=toy plays toy:train, evaluation scores toy:test)."""

    CHECKS_TURNS = True  # each turn's state is compared with the gold calls'

    def __init__(self, source):
        split = source.split(":", 1)[1] if ":" in source else "train"
        self.source, self.categories, self.tasks = source, CATEGORIES, {t["id"]: t for t in SPLITS[split]}

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        from common.engine import episode
        records, timing = episode.play(tasks, n, engine, spec, Session, round_=round_, policy=policy)
        return [r | {"env": "toy"} for r in records], timing

    def diagnose(self, task, rollout):
        from common.seal import taxonomy as T
        made, gold, labelled = copy.deepcopy(task["state"]), copy.deepcopy(task["state"]), []
        for k, gold_calls in enumerate(task["gold"]):
            steps = rollout["turns"][k]["steps"] if k < len(rollout["turns"]) else []
            calls = [c for s in steps for c in s["calls"]]
            turn = types.SimpleNamespace(index=k, parse_errors=[s["parse_error"] for s in steps if s["parse_error"]],
                                         schema_errors=[(c, e) for s in steps
                                                        for c, e in zip(s["calls"], s["schema_errors"], strict=True) if e])
            for c in calls:
                if c not in [bad for bad, _ in turn.schema_errors]:  # as the session ran them
                    run_call(made, c)
            for c in gold_calls:
                run_call(gold, c)
            if made == gold and calls:
                labelled.append(("pass", f"store as the gold calls leave it ({len(calls)} call(s))"))
                continue
            labelled.append(T.label(turn, RULES, calls, made, gold))
        labels = [z for z, _ in labelled]
        valid = made == gold and len(rollout["turns"]) == len(task["gold"])
        return {"task_id": task["id"], "category": task["category"], "sample_index": rollout.get("sample_index", 0),
                "round": rollout.get("round", 0), "reward": int(valid),
                "official": {"valid": valid, "error_type": None if valid else "toy:store_differs"},
                "turn_labels": labels, "evidence": [e for _, e in labelled], "profile": T.profile(labels)}

    @staticmethod
    def cut_stops(short_context):
        return {"context_limit"} if short_context else set()

    def evaluate(self, out, policy, spec, engine, *, limit=None, trials=None, concurrency=None):
        from common.engine import calls as C
        from common.jsonl import write_json, write_jsonl
        from common.run.scores import mean, percent_by_group
        tasks = [t for c in CATEGORIES for t in [t for t in self.tasks.values() if t["category"] == c][:limit]]
        if policy == "oracle":
            records = [{"turns": [{"steps": [{"calls": g, "parse_error": None, "schema_errors": [None] * len(g),
                                              "text": C.format_calls(g, spec.fmt)}]} for g in t["gold"]]} for t in tasks]
        else:
            with engine() as eng:
                records, _ = self.play(tasks, 1, eng, spec, policy=os.path.abspath(policy))
            write_jsonl(os.path.join(out, "rollouts.jsonl"), records)
        results = [{"task_id": t["id"], "category": t["category"], **self.diagnose(t, r)["official"]}
                   for t, r in zip(tasks, records, strict=True)]
        scores = {c: v for c, v in percent_by_group(results, CATEGORIES, "category", "valid").items() if v is not None}
        scores["average"] = mean(scores.values()) or 0.0
        write_jsonl(os.path.join(out, "results.jsonl"), results)
        write_json(os.path.join(out, "scores.json"), scores)
        return scores

    # the views

    @staticmethod
    def columns(env):
        return CATEGORIES

    view_categories = columns

    @staticmethod
    def eval_title(env, scores):
        return "Toy key-value store (test split, %)"

    @staticmethod
    def plot_title(env):
        return "toy test split (%)"

    @staticmethod
    def eval_tasks(env):
        return f"{env}:test"

    @staticmethod
    def view_tasks(source):
        return Toy(source).tasks

    @staticmethod
    def task_view(task):
        return {"category": task["category"], "questions": [[{"role": "user", "content": t}] for t in task["turns"]],
                "gt_calls": task["gold"]}

    @staticmethod
    def compare_columns(scores):
        return [c for c in CATEGORIES if any(c in sc for sc in scores)]

    @staticmethod
    def score_notes(sc):
        return []

    @staticmethod
    def references(scores):
        return []

    @staticmethod
    def tiny(setting, args):
        return WarmStart(args)


class WarmStart:
    """The tiny model's warm start: each train task's gold outputs, and `miss_share` of the time its near miss
    (the last value suffixed "_old"), played through the rollouts' own engine path, both views of the tools."""

    steps = None  # the build's own

    def __init__(self, args):
        self.args, self.env, self.info = args, Toy("toy:train"), {"tasks": "toy:train", "preset_tasks": None}

    def key(self):
        return json.dumps([TOOLS, SPLITS], sort_keys=True).encode()

    def scripts(self, task):
        from common.engine import calls as C
        from common.run.tiny import near_miss
        right = [t for calls in task["gold"] for t in (C.format_calls(calls, "json"), DONE)]
        miss = [t for calls in task["gold"][:-1] for t in (C.format_calls(calls, "json"), DONE)]
        return right, miss + [C.format_calls(near_miss(task["gold"][-1]), "json"), DONE]

    def texts(self):
        from common.run.tiny import CHAT_TEMPLATE
        texts = [CHAT_TEMPLATE, *(json.dumps(t) for t in TOOLS)]
        for task in self.env.tasks.values():
            texts += task["turns"] + [t for s in self.scripts(task) for t in s]
        return texts

    def examples(self, tok, bpe):
        from common.engine.episode import PlaySpec
        from common.run.tiny import ScriptEngine, token_examples
        from common.seal import interface as omega_api
        share, examples, weights = self.args["miss_share"], [], []
        for omega in (None, omega_api.initial()):
            for task in self.env.tasks.values():
                for texts, w in zip(self.scripts(task), (1 - share, share), strict=True):
                    engine = ScriptEngine(tok, iter(texts).__next__)
                    (record,), _ = self.env.play([task], 1, engine, PlaySpec(omega=omega, schedule="lockstep"))
                    t = record["tokens"]
                    made = token_examples(t["prompt_ids"], t["ids"], t["mask"], self.args["context"])
                    examples += made
                    weights += [w] * len(made)
        return examples, weights
