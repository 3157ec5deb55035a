"""The environment a stage plays and judges: `--tasks` names it.

    --tasks data/train.jsonl       BFCL V3 multi-turn: bfcl-eval's classes and checker (common/bfcl.py)
    --tasks tau2:airline:train     a τ²-bench domain's split: τ²'s orchestrator, user simulator and
                                   evaluator (common/tau2.py); any domain in τ²'s registry

What the stages need of an environment is four things, and nothing else differs between them:

    env.categories                       what scores and summaries are grouped by, in order
    env.tasks                            the tasks by id: dicts with "id" and "category"
    env.play(tasks, n, engine, spec, round_=, policy=)   rollout records (docs/design.md §3)
    env.diagnose(task, rollout)          a diagnosis record: the environment's own reward, a
                                         label per user turn (common/taxonomy.py), the profile

and, for training, which ends of its episodes are not the policy's failure under evaluation's rules
(train_grpo.py --cut mask leaves them out of the loss): cut_stops(record, short_context) below; and
whether its checker judges each user turn on its own (checks_turns(record): turn credit clears a
turn labelled pass only where the checker verified it at that turn, docs/design.md §6).

For the views (common/report.py, common/view.py, common/tracking.py), each class answers for a
run's `env` setting (KIND or KIND:DOMAIN; KINDS below, kind_of) without loading anything else:
columns(env) and view_categories(env), the evaluation's score columns and the viewer's categories;
eval_title(env, scores) and plot_title(env); eval_tasks(env) and view_tasks(source), the tasks whose
task_view(task) the viewer and trackers show beside the plays (τ²'s: none, its records carry the user
turns); and, across runs, compare_columns(scores), score_notes(sc) and references(scores).

A new environment is one more class here, its line in KINDS, and the module that plays it; the stages
do not change.
"""

import os

from common.jsonl import RecordError

TAU2 = "tau2:"


def is_tau2(tasks):
    return tasks.startswith(TAU2)


def load(tasks, user=None, user_log=None, max_steps=None):
    """The environment of `--tasks` (a BFCL task file, or tau2:DOMAIN:SPLIT). A τ² episode's
    settings: `user`, its user simulator ("scripted", common/tau2.py ScenarioUser, or a tau2.User,
    whose server, if it names a local model, runs during play() with its log at `user_log`), and
    `max_steps`, τ²'s orchestrator steps an episode may take (default τ²'s 200)."""
    if is_tau2(tasks):
        return Tau2Env(tasks, user, user_log, max_steps or 200)
    if user is not None or max_steps is not None:
        raise RecordError(f"{tasks}: BFCL tasks script their user turns; a user simulator is for τ² tasks")
    return BFCL(tasks)


def cut_stops(record, short_context):
    """The `stop` values that cut a rollout record of its environment (a τ² record names it in "env"):
    ends that are not the policy's failure under evaluation's rules. `short_context`: the rollouts'
    context is shorter than evaluation's, so that a context limit is training's own, not evaluation's."""
    return kind_of(record.get("env")).cut_stops(short_context)


def checks_turns(record):
    """Whether the environment of a rollout record checks every user turn on its own, so that a turn
    its diagnosis labels pass or correct_abstention was verified right at that turn (BFCL: bfcl-eval's
    state and response checkers after each turn), or judges the episode once (τ²: the database at the
    end, the actions, what was communicated)."""
    return kind_of(record.get("env")).CHECKS_TURNS


class BFCL:
    """BFCL V3 multi-turn: scripted user turns, bfcl-eval's executable classes, its checker."""

    CHECKS_TURNS = True  # the official state and response checkers run after every turn

    def __init__(self, path):
        from common import bfcl
        self.source, self.categories, self.tasks = path, bfcl.CATEGORIES, bfcl.load_tasks(path)

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        from common import play
        return play.play(tasks, n, engine, spec, round_=round_, policy=policy)

    def diagnose(self, task, rollout):
        from common import taxonomy
        return taxonomy.diagnose(task, rollout)

    @staticmethod
    def cut_stops(short_context):
        from common import play
        return play.cut_stops(short_context)

    # the views (report, viewer, trackers) of a run whose `env` setting is "bfcl"

    @staticmethod
    def columns(env):
        from common import bfcl
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
        from common import bfcl
        return bfcl.load_tasks(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), source))

    @staticmethod
    def compare_columns(scores):
        from common import bfcl
        return [c for c in bfcl.CATEGORIES if any(c in sc for sc in scores)]

    @staticmethod
    def score_notes(sc):
        from common.bfcl_results import LEADERBOARD, LEADERBOARD_TASKS
        e = sc.get("bfcl_eval", {})
        notes = [] if e.get("same_settings", True) else ["* not bfcl-eval's settings: " + "; ".join(e["differs"])]
        if e.get("registry") in LEADERBOARD and e.get("tasks") != LEADERBOARD_TASKS:
            notes.append(f"† {e.get('tasks', 'not all')} tasks; the leaderboard's figure is over all {LEADERBOARD_TASKS}")
        return notes

    @staticmethod
    def references(scores):
        """The BFCL leaderboard's figure of each bfcl-eval entry the scores were scored under."""
        from common.bfcl_results import LEADERBOARD, LEADERBOARD_TASKS
        board = {e["registry"]: LEADERBOARD[e["registry"]] for sc in scores
                 if (e := sc.get("bfcl_eval", {})).get("registry") in LEADERBOARD}
        return [("BFCL leaderboard", figure, f"{registry}, all {LEADERBOARD_TASKS} tasks ({source})")
                for registry, (figure, source) in board.items()]

    @staticmethod
    def task_view(task):
        from common import bfcl
        try:
            gt = [bfcl.ground_truth_calls(task, k) for k in range(len(task["ground_truth"]))]
        except RecordError:
            gt = None
        return {"category": task["category"], "questions": task["questions"], "ground_truth": task["ground_truth"],
                "gt_calls": gt}


class Tau2Env:
    """A τ²-bench domain's split: its user simulator opens and answers every turn, τ²'s tools act on
    its database, τ²'s evaluator scores each episode."""

    CHECKS_TURNS = False  # one verdict per episode, which the labelling rules place on its turns

    def __init__(self, source, user, user_log=None, max_steps=200):
        from common import tau2
        parts = source[len(TAU2):].split(":")
        if len(parts) != 2 or not all(parts):
            raise RecordError(f"{source}: τ² tasks are named tau2:DOMAIN:SPLIT (e.g. tau2:airline:train)")
        self.domain, self.split = parts
        self.source, self.categories, self.user, self.user_log = source, [self.domain], user, user_log
        self.max_steps = max_steps
        self.tau2 = tau2.import_tau2()
        loaded = self.tau2.tasks(self.domain, split=self.split)  # RecordError for an unknown domain or split
        self.tasks = {t.id: {"id": t.id, "category": self.domain, "tau2": t} for t in loaded if tau2.playable(t)}

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        from common import tau2
        if self.user is None:
            raise RecordError(f"{self.source}: no user simulator given (a tau2.User, or 'scripted')")
        with tau2.user_simulator(None if self.user == "scripted" else self.user, self.user_log,
                                 [self.domain]) as (user_sim, ready):
            ready()  # a served user model is up and, on a domain whose user has tools, calls them
            return tau2.rollouts(self.tau2, self.domain, [t["tau2"] for t in tasks], n, engine, spec, user_sim,
                                 round_=round_, policy=policy, max_steps=self.max_steps)

    def diagnose(self, task, rollout):
        from common import tau2
        return tau2.diagnose(self.tau2, self.domain, task["tau2"], rollout)

    @staticmethod
    def cut_stops(short_context):
        from common import tau2
        return tau2.cut_stops(short_context)

    def evaluate(self, out, policy, spec, engine, *, limit=None, trials=1, concurrency=None):
        """Score `policy` on this split (evaluate.py --tasks tau2:DOMAIN:SPLIT): every task `trials`
        times on the engine `engine()` opens, against this environment's user (None: `--policy oracle`,
        the gold actions and a scripted user), by τ²'s evaluator with pass^1..pass^trials; writes
        out/results.jsonl and out/scores.json, as `python -m ood.tau --domain DOMAIN --split SPLIT`."""
        from common import tau2
        return tau2.evaluate(out, policy, spec, self.user, engine, domains=[self.domain], limit=limit,
                             concurrency=concurrency, max_episode_steps=self.max_steps, split=self.split,
                             trials=trials)

    # the views of a run whose `env` setting is "tau2:DOMAIN"; its records carry their user turns

    @staticmethod
    def columns(env):
        return [env.split(":", 1)[1]]

    view_categories = columns

    @staticmethod
    def eval_title(env, scores):
        """Every τ² score says its split, its trials and its user simulator."""
        sim, k = (scores or {}).get("user_simulator") or {}, (scores or {}).get("trials", 1)
        trials = f" and pass^{k} over {k} trials" if k > 1 else ""
        return (f"In distribution (τ²-bench {env.split(':', 1)[1]}, test split, pass^1{trials} %; user simulator: "
                f"{sim.get('model') or sim.get('name') or sim.get('note') or sim.get('kind', '?')})")

    @staticmethod
    def plot_title(env):
        return "τ² test split (pass^1, %)"

    @staticmethod
    def eval_tasks(env):
        return f"{env}:test"

    @staticmethod
    def compare_columns(scores):  # the domains of τ²'s scores (ood/tau.py's name theirs)
        return list(dict.fromkeys(d for sc in scores if "tau2_version" in sc for d in sc.get("tasks", {})))

    @staticmethod
    def score_notes(sc):
        return [f"τ² {sc['split']} split"] if "tau2_version" in sc else []

    @staticmethod
    def references(scores):
        return []

    @staticmethod
    def view_tasks(source):
        return {}  # nothing to load: a record holds the user simulator's messages (turns[k].user)

    @staticmethod
    def task_view(task):
        return {"category": task["category"]}


KINDS = {"bfcl": BFCL, "tau2": Tau2Env}  # the environment kinds: a run's `env` setting is KIND or KIND:DOMAIN


def kind_of(setting):
    """The environment class of a run's `env` setting ("bfcl", "tau2:DOMAIN"), a `--tasks` value or a
    record's "env": the kind before the first colon; a BFCL task file, or nothing, is BFCL."""
    return KINDS.get((setting or "").split(":", 1)[0], BFCL)
