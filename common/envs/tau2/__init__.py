"""τ²-bench domains as an environment: τ²'s orchestrator, user simulator and evaluator."""

from common.jsonl import RecordError

TAU2 = "tau2:"


class Tau2Env:
    """A τ²-bench domain's split: its user simulator opens and answers every turn, τ²'s tools act on
    its database, τ²'s evaluator scores each episode."""

    CHECKS_TURNS = False  # one verdict per episode, which the labelling rules place on its turns

    def __init__(self, source, user, user_log=None, max_steps=200):
        from common.envs.tau2 import tau2
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
        from common.envs.tau2 import tau2
        if self.user is None:
            raise RecordError(f"{self.source}: no user simulator given (a tau2.User, or 'scripted')")
        with tau2.user_simulator(None if self.user == "scripted" else self.user, self.user_log,
                                 [self.domain]) as (user_sim, ready):
            ready()  # a served user model is up and, on a domain whose user has tools, calls them
            return tau2.rollouts(self.tau2, self.domain, [t["tau2"] for t in tasks], n, engine, spec, user_sim,
                                 round_=round_, policy=policy, max_steps=self.max_steps)

    def diagnose(self, task, rollout):
        from common.envs.tau2 import tau2
        return tau2.diagnose(self.tau2, self.domain, task["tau2"], rollout)

    @staticmethod
    def cut_stops(short_context):
        from common.envs.tau2 import tau2
        return tau2.cut_stops(short_context)

    def evaluate(self, out, policy, spec, engine, *, limit=None, trials=1, concurrency=None):
        """Score `policy` on this split (evaluate.py --tasks tau2:DOMAIN:SPLIT): every task `trials`
        times on the engine `engine()` opens, against this environment's user (None: `--policy oracle`,
        the gold actions and a scripted user), by τ²'s evaluator with pass^1..pass^trials; writes
        out/results.jsonl and out/scores.json, as `python -m ood.tau --domain DOMAIN --split SPLIT`."""
        from common.envs.tau2 import tau2
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
