"""BFCL V3 multi-turn as an environment: bfcl-eval's executable classes, prompts and checker."""

import os

from common.jsonl import RecordError
from common.presets import ROOT


class BFCL:
    """BFCL V3 multi-turn: scripted user turns, bfcl-eval's executable classes, its checker."""

    CHECKS_TURNS = True  # the official state and response checkers run after every turn

    def __init__(self, path):
        from common.envs.bfcl import harness as bfcl
        self.source, self.categories, self.tasks = path, bfcl.CATEGORIES, bfcl.load_tasks(path)

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        from common.envs.bfcl import play
        return play.play(tasks, n, engine, spec, round_=round_, policy=policy)

    def diagnose(self, task, rollout):
        from common.seal import taxonomy
        return taxonomy.diagnose(task, rollout)

    @staticmethod
    def cut_stops(short_context):
        from common.envs.bfcl import play
        return play.cut_stops(short_context)

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
