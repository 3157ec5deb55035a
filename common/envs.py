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

A new environment is one more class here and the module that plays it; the stages do not change.
"""

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
    return (Tau2Env if is_tau2(record.get("env") or "") else BFCL).cut_stops(short_context)


def checks_turns(record):
    """Whether the environment of a rollout record checks every user turn on its own, so that a turn
    its diagnosis labels pass or correct_abstention was verified right at that turn (BFCL: bfcl-eval's
    state and response checkers after each turn), or judges the episode once (τ²: the database at the
    end, the actions, what was communicated)."""
    return (Tau2Env if is_tau2(record.get("env") or "") else BFCL).CHECKS_TURNS


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
