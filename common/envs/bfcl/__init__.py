"""BFCL V3 multi-turn as an environment: bfcl-eval's executable classes, prompts and checker."""

import os

from common.jsonl import RecordError
from common.presets import ROOT


class BFCL:
    """BFCL V3 multi-turn: scripted user turns, bfcl-eval's executable classes, its checker."""

    CHECKS_TURNS = True  # the official state and response checkers run after every turn

    BENCHES = ("bfcl-memory", "bfcl-web")  # BFCL V4's, evaluation only (common/envs/bfcl/memory.py)
    HELDIN = "bfcl-heldin"  # the held-in split as an OOD bench (a τ²-trained run's)

    def __init__(self, path, tasks=None):
        from common.envs.bfcl import harness as bfcl
        self.source, self.categories = path, bfcl.CATEGORIES
        self.tasks = bfcl.load_tasks(path) if tasks is None else tasks

    @classmethod
    def from_args(cls, source, args, parser, evaluation=False):
        """evaluate.py's: a task file or --split (bfcl-heldin: held-in), or BFCL V4's memory and web search."""
        if not evaluation:
            return cls(source)
        from common.envs.bfcl import evaluate, memory, prompts, results
        if source in cls.BENCHES:
            if args.split or args.bfcl_model:
                parser.error(f"--split and --bfcl-model are BFCL multi-turn's, not {source}'s")
            env = cls(source, {})
            env.memory = memory.categories(source, args.memory_backend or memory.BACKENDS, args.memory_scenario)
        else:
            if args.memory_backend or args.memory_scenario:
                parser.error(f"--memory-backend and --memory-scenario are for --tasks {' or '.join(cls.BENCHES)}")
            path = None if source in (None, cls.HELDIN) else source
            if path and not os.path.isfile(path):
                parser.error(f"--tasks {path}: no such task file (a BFCL task file, or KIND:... of "
                             "common/envs/__init__.py)")
            tasks, which = evaluate.split_tasks(args.split or "heldin", path)
            env = cls(path or args.split or "heldin", {t["id"]: t for t in tasks})
            env.which, env.memory = which, None
            env.bfcl_model = args.bfcl_model or prompts.registry_name(args.handler)
            try:
                results.handler(env.bfcl_model)  # before anything is played
            except RecordError as e:
                parser.error(f"--bfcl-model: {e}")
        env.decoding, env.scenario, env.engine_name = args.decoding or "bfcl", args.memory_scenario, args.engine
        return env

    @staticmethod
    def add_args(parser, evaluation=False):
        if not evaluation:
            return
        parser.add_argument("--split", default=None, choices=["heldin", "train", "all"],
                            help="heldin (the default), train: the paper's split (data/<split>.jsonl); all: "
                                 "bfcl-eval's 800 tasks, the BFCL leaderboard's")
        parser.add_argument("--bfcl-model", default=None,
                            help="bfcl-eval registry entry that names and decodes OUT/result/ (docs/bfcl-results.md; "
                                 "default: the --handler's, common/envs/bfcl/prompts.py HANDLERS)")
        parser.add_argument("--decoding", default=None, choices=["bfcl", "greedy"],
                            help="bfcl (the default): temperature 0.001 with the model's generation_config "
                                 "defaults (bfcl-eval's vLLM server); greedy: argmax")
        parser.add_argument("--memory-backend", nargs="+", default=None, choices=["kv", "vector", "rec_sum"],
                            help="bfcl-memory: the backends to run (default: all three; `memory` is their mean)")
        parser.add_argument("--memory-scenario", default=None,
                            choices=["customer", "finance", "healthcare", "notetaker", "student"],
                            help="bfcl-memory: only this scenario's questions and prerequisite conversations")

    def evaluate(self, out, policy, spec, engine, *, limit=None, trials=None, concurrency=None):
        if self.memory:
            from common.envs.bfcl import memory
            return memory.evaluate(out, policy, spec, engine, self.memory, scenario=self.scenario,
                                   limit=limit, engine_name=self.engine_name)
        from common.envs.bfcl import evaluate
        return evaluate.evaluate(self, out, policy, spec, engine, limit)

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        from common.envs.bfcl import play
        return play.play(tasks, n, engine, spec, round_=round_, policy=policy)

    def diagnose(self, task, rollout):
        from common.envs.bfcl import diagnose
        return diagnose.diagnose(task, rollout)

    @staticmethod
    def cut_stops(short_context):
        """bfcl-eval's inference error, and a context shorter than evaluation's: not the policy's failure."""
        return {"inference_error"} | ({"context_limit"} if short_context else set())

    # a run's settings (common/presets.py; standard library only)

    @classmethod
    def preset(cls, p, changes):
        from common.presets import PresetError
        if p.env != "bfcl":
            raise PresetError(f"ENV={p.env}: BFCL is ENV=bfcl (its tasks: TASKS)")
        if cls.HELDIN in p.ood.split():
            raise PresetError(f"OOD={cls.HELDIN} is another environment's run's; held-in is this run's own score")
        return {}

    @classmethod
    def eval_args(cls, p, tasks):
        return ["--bfcl-model", p.bfcl_model] if p.bfcl_model and tasks not in cls.BENCHES else []

    @staticmethod
    def tiny(setting, args):
        from common.envs.bfcl import tiny
        return tiny.WarmStart(args)

    # the views (report, viewer, trackers) of a run whose `env` setting is "bfcl"

    @staticmethod
    def columns(env):
        from common.envs.bfcl import harness as bfcl
        return bfcl.CATEGORIES

    view_categories = columns

    @staticmethod
    def eval_title(env, scores):
        return "Held-in (BFCL multi-turn @ bfcl-eval 2026.3.23, %)"

    @staticmethod
    def plot_title(env):
        return "held-in score (average, %)"

    @staticmethod
    def eval_tasks(env):
        return "data/heldin.jsonl"

    @staticmethod
    def view_tasks(source):  # a task file, from the repository's root unless absolute
        from common.envs.bfcl import harness as bfcl
        return bfcl.load_tasks(os.path.join(ROOT, source))

    @staticmethod
    def compare_columns(scores):
        from common.envs.bfcl import harness as bfcl
        return [c for c in bfcl.CATEGORIES if any(c in sc for sc in scores)]

    @staticmethod
    def score_notes(sc):
        from common.envs.bfcl.results import LEADERBOARD, LEADERBOARD_TASKS
        e = sc.get("bfcl_eval", {})
        notes = [] if e.get("same_settings", True) else ["* not bfcl-eval's settings: " + "; ".join(e["differs"])]
        if e.get("registry") in LEADERBOARD and e.get("tasks") != LEADERBOARD_TASKS:
            notes.append(f"† {e.get('tasks', 'not all')} tasks; the leaderboard's figure is over all {LEADERBOARD_TASKS}")
        return notes

    @staticmethod
    def references(scores):
        """The BFCL leaderboard's figure of each bfcl-eval entry the scores were scored under."""
        from common.envs.bfcl.results import LEADERBOARD, LEADERBOARD_TASKS
        board = {e["registry"]: LEADERBOARD[e["registry"]] for sc in scores
                 if (e := sc.get("bfcl_eval", {})).get("registry") in LEADERBOARD}
        return [("BFCL leaderboard", figure, f"{registry}, all {LEADERBOARD_TASKS} tasks ({source})")
                for registry, (figure, source) in board.items()]

    @staticmethod
    def task_view(task):
        from common.envs.bfcl import harness as bfcl
        try:
            gt = [bfcl.ground_truth_calls(task, k) for k in range(len(task["ground_truth"]))]
        except RecordError:
            gt = None
        return {"category": task["category"], "questions": task["questions"], "ground_truth": task["ground_truth"],
                "gt_calls": gt}
