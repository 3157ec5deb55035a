"""Any MCP server as an environment: `--tasks mcp:DIR:SPLIT`, `ENV=mcp:DIR` (docs/environments.md, MCP servers).

DIR holds env.json (the server's stdio command, its state probes) and SPLIT.jsonl (scripted user
turns, gold calls per turn). Every episode and every replay gets a fresh server process
(server.py); tasks.py checks the folder, verdict.py judges and labels an episode.
"""

import json
import os

from common.jsonl import RecordError, write_json, write_jsonl
from common.presets import ROOT

PREFIX = "mcp:"
WAVE = 64  # episodes whose servers run at once: one process each


def parse(source):
    """(DIR, SPLIT) of `mcp:DIR:SPLIT`."""
    folder, _, split = source[len(PREFIX):].rpartition(":")
    if not folder or not split:
        raise RecordError(f"{source}: MCP tasks are named mcp:DIR:SPLIT (e.g. mcp:docs/examples/mcp_board:train), "
                          "DIR holding env.json and SPLIT.jsonl")
    return folder, split


def _folder(env):
    """DIR of a run's `env` setting (mcp:DIR), from the repository's root unless absolute."""
    return os.path.join(ROOT, env[len(PREFIX):].split(":")[0])


class MCP:
    """An MCP server's tools, a task file's scripted turns and gold calls, BFCL's checker rules."""

    CHECKS_TURNS = True  # the state and response checks run after every turn
    # The tiny preset on ENV=mcp:DIR: the first TINY_TASKS train tasks (TRAIN_LIMIT), those its model's warm
    # start learnt (common/envs/mcp/tiny.py), and room for a call (MAX_NEW).
    TINY_TASKS, TINY_MAX_NEW = 8, 128

    def __init__(self, source):
        from common.envs.mcp import tasks as T
        from common.envs.mcp import verdict

        folder, split = parse(source)
        self.source, self.env = source, f"{PREFIX}{folder}"
        self.spec = T.read_spec(folder)
        self.tasks = T.read_tasks(os.path.join(folder, f"{split}.jsonl"), os.path.basename(self.spec["dir"]))
        self.categories = list(dict.fromkeys(t["category"] for t in self.tasks.values()))
        try:
            with T.start(self.spec) as server:
                self.tools = server.tools
        except T.S.ServerFault as e:
            raise RecordError(f"{os.path.join(folder, 'env.json')}: {e}") from None
        T.check(self.spec, self.tasks, self.tools)
        self.gold = T.check_gold(self.spec, self.tasks, verdict.gold_replay)  # the verdict's, replayed once
        # replays by task and calls: a server answers the same calls alike (the oracle's check relies on it),
        # so a GRPO group's samples that made the same calls, and the oracle, replay once
        self.replays = {(i, json.dumps(t["gold"], sort_keys=True)): (self.gold[i], None) for i, t in self.tasks.items()}

    def session(self, task):
        """One episode's environment (server.Session): a fresh server for `task`."""
        from common.envs.mcp.server import Session
        return Session(self.spec, task)

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        """Rollout records of `n` episodes of every task (common/engine/episode.py), each on its own
        fresh server: the tasks play in waves of at most WAVE episodes, their servers started 16 at once."""
        records, timing, per_wave = [], {}, max(1, WAVE // n)
        for i in range(0, max(len(tasks), 1), per_wave):
            recs, t = self._play_wave(tasks[i:i + per_wave], n, engine, spec, round_, policy)
            records += recs
            timing = {k: timing.get(k, 0) + v for k, v in t.items()}
        return [r | {"env": self.env} for r in records], timing

    def _play_wave(self, tasks, n, engine, spec, round_, policy):
        from concurrent.futures import ThreadPoolExecutor

        from common.engine import episode
        jobs = [t for t in tasks for _ in range(n)]
        with ThreadPoolExecutor(max(1, min(16, len(jobs)))) as pool:
            opened = list(pool.map(self.session, jobs))
        try:
            return episode.play(tasks, n, engine, spec, lambda task: opened.pop(0), round_=round_, policy=policy)
        finally:
            for session in opened:
                session.close()

    def diagnose(self, task, rollout):
        from common.envs.mcp import verdict

        def replay(turns):
            key = (task["id"], json.dumps(turns, sort_keys=True))
            if key not in self.replays:
                self.replays[key] = verdict.run_turns(self.spec, turns)
            return self.replays[key]
        return verdict.diagnose(self.tools, task, rollout, self.gold[task["id"]], replay)

    @staticmethod
    def cut_stops(short_context):
        """The server's failure (a crash, a hang past env.json's timeout, an answer outside the
        protocol) is the environment's, and a context shorter than evaluation's is training's."""
        return {"server_error"} | ({"context_limit"} if short_context else set())

    def oracle_records(self, tasks, fmt):
        """The gold calls played as the model's outputs, each turn closed by an answer stating its facts."""
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda task: self.oracle_record(task, fmt), tasks))

    def oracle_record(self, task, fmt):
        from common.envs.mcp import verdict
        session, turns = self.session(task), []
        try:
            for texts in verdict.oracle_texts(task, fmt):
                turns.append({"steps": [{"text": t, **session.step(t, fmt)} for t in texts], "end": "answer"})
        finally:
            session.close()
        return {"task_id": task["id"], "category": task["category"], "sample_index": 0, "round": 0,
                "policy": "oracle", "turns": turns, "stop": "done", "env": self.env}

    def evaluate(self, out, policy, spec, engine, *, limit=None, trials=1, concurrency=None):
        """Score `policy` (a model folder on the engine `engine()` opens, or "oracle": the gold calls)
        on this split, once per task, greedy and Ω removed: out/rollouts.jsonl, out/results.jsonl
        (one verdict per task) and out/scores.json (percent per category and their average)."""
        from common.run.scores import mean, percent_by_group
        tasks = list(self.tasks.values())[:limit] if limit else list(self.tasks.values())
        if policy == "oracle":
            records = self.oracle_records(tasks, spec.fmt)
        else:
            with engine() as eng:
                records, _ = self.play(tasks, 1, eng, spec, policy=os.path.abspath(policy))
            write_jsonl(os.path.join(out, "rollouts.jsonl"), records)
        results = [{"task_id": r["task_id"], "category": r["category"],
                    **self.diagnose(self.tasks[r["task_id"]], r)["official"]} for r in records]
        scores = {c: v for c, v in percent_by_group(results, self.categories, "category", "valid").items()
                  if v is not None}
        scores["average"] = mean(scores.values()) or 0.0
        scores["tasks"] = self.source
        write_jsonl(os.path.join(out, "results.jsonl"), results)
        write_json(os.path.join(out, "scores.json"), scores)
        print(f"{policy} on {len(tasks)} tasks of {self.source}: " +
              "  ".join(f"{c} {v:.2f}" for c, v in scores.items() if c != "tasks"))
        return scores

    # a run's settings (common/presets.py; standard library only)

    @classmethod
    def preset(cls, p, changes):
        """ENV=mcp:DIR: DIR holds env.json (from the repository's root unless absolute); on the tiny preset
        the tasks its model learnt and room for a call."""
        from common.presets import PresetError
        folder = p.env[len(PREFIX):]
        if not folder or ":" in folder or not os.path.isfile(os.path.join(ROOT, folder, "env.json")):
            raise PresetError(f"ENV={p.env}: use mcp:DIR, DIR a folder holding env.json, train.jsonl and test.jsonl "
                              "(docs/environments.md, MCP servers)")
        out = {"train_limit": str(cls.TINY_TASKS), "max_new": str(cls.TINY_MAX_NEW)} if p.model == "offline-tiny" else {}
        return {f: v for f, v in out.items() if f not in changes}

    @staticmethod
    def tiny(setting, args):
        from common.envs.mcp import tiny
        return tiny.WarmStart(setting, args)

    # the views of a run whose `env` setting is "mcp:DIR"

    @staticmethod
    def columns(env):
        from common.envs.mcp import tasks as T
        folder = _folder(env)
        try:
            tasks = T.read_tasks(os.path.join(folder, "test.jsonl"), os.path.basename(os.path.abspath(folder)))
        except RecordError:
            return [os.path.basename(os.path.abspath(folder))]
        return list(dict.fromkeys(t["category"] for t in tasks.values()))

    view_categories = columns

    @staticmethod
    def eval_title(env, scores):
        return f"Held out (MCP server {env[len(PREFIX):]}, test split, %)"

    @staticmethod
    def plot_title(env):
        return "test split (%)"

    @staticmethod
    def eval_tasks(env):
        return f"{env}:test"

    @staticmethod
    def view_tasks(source):
        from common.envs.mcp import tasks as T
        folder, split = parse(source)
        folder = os.path.join(ROOT, folder)
        return T.read_tasks(os.path.join(folder, f"{split}.jsonl"), os.path.basename(os.path.abspath(folder)))

    @staticmethod
    def task_view(task):
        from common.engine import calls as C
        return {"category": task["category"], "questions": [[{"role": "user", "content": t}] for t in task["turns"]],
                "ground_truth": [[C.format_calls([c], "python") for c in calls] for calls in task["gold"]],
                "gt_calls": task["gold"]}

    @staticmethod
    def compare_columns(scores):  # the categories of MCP scores
        return list(dict.fromkeys(c for sc in scores if str(sc.get("tasks", "")).startswith(PREFIX)
                                  for c in sc if c not in ("average", "tasks")))

    @staticmethod
    def score_notes(sc):
        return [f"MCP {sc['tasks']}"] if str(sc.get("tasks", "")).startswith(PREFIX) else []

    @staticmethod
    def references(scores):
        return []
