"""τ²-bench domains as an environment: τ²'s orchestrator, user simulator and evaluator."""

import os

from common.jsonl import RecordError


class Tau2Env:
    """A τ²-bench domain's split: its user simulator opens and answers every turn, τ²'s tools act on
    its database, τ²'s evaluator scores each episode."""

    CHECKS_TURNS = False  # one verdict per episode, which the labelling rules place on its turns
    # the tiny preset's TRAIN_LIMIT (the tasks its warm start learnt) and MAX_NEW: docs/environments.md §2
    TINY_TASKS, TINY_MAX_NEW = 8, 160
    # a GPU preset's rollout context: 2.6x the oracle's longest episode (docs/environments.md §2)
    MAX_LEN = 32768

    def __init__(self, source, user=None, user_log=None, max_steps=200, bench=False):
        """`source`: tau2:DOMAIN:SPLIT; with `bench` (evaluation) also tau2 (τ²-bench's domains) and
        tau2:DOMAIN[,DOMAIN...] with or without SPLIT (none: the paper's task set)."""
        from common.envs.tau2 import tau2
        parts = source.split(":")[1:]
        domains = parts[0].split(",") if parts else list(tau2.DOMAINS)
        if not (bench and len(parts) <= 2 or len(parts) == 2 and len(domains) == 1) or not all(domains + parts) \
                or len(set(domains)) < len(domains):
            raise RecordError(f"{source}: τ² tasks are named tau2:DOMAIN:SPLIT (e.g. tau2:airline:train)")
        self.domains, self.domain, self.split = domains, domains[0], parts[1] if len(parts) == 2 else None
        self.source, self.categories, self.user, self.user_log = source, domains, user, user_log
        self.max_steps, self.trials, self.concurrency = max_steps, 1, None
        self.tau2 = tau2.import_tau2()
        self.tasks = {t.id: {"id": t.id, "category": d, "tau2": t} for d in domains  # RecordError: no such domain
                      for t in self.tau2.tasks(d, split=self.split) if tau2.playable(t)}

    @classmethod
    def from_args(cls, source, args, parser, evaluation=False):
        """The environment of a stage's flags (add_args): its user simulator, steps, trials."""
        from common.envs.tau2 import tau2
        if evaluation and any(v is not None and v < 1 for v in (args.trials, args.concurrency, args.max_episode_steps)):
            parser.error("--trials, --concurrency and --max-episode-steps must be at least 1")
        user = tau2.user_of_args(args, parser)  # None: the oracle's scripted user
        log = None if evaluation else os.path.splitext(args.out)[0] + ".user.log"
        env = cls(source, user, log, args.max_episode_steps or 200, bench=evaluation)
        if evaluation:
            env.trials, env.concurrency = args.trials or 1, args.concurrency
        return env

    @staticmethod
    def add_args(parser, evaluation=False):
        from common.envs.tau2 import tau2
        tau2.add_user_args(parser)
        parser.add_argument("--max-episode-steps", type=int, default=None,
                            help="τ² tasks: orchestrator steps an episode may take (default: τ²'s 200)")
        if evaluation:
            parser.add_argument("--trials", type=int, default=None,
                                help="τ² tasks: episodes per task (default 1): scores.json gets pass^1..pass^K")
            parser.add_argument("--concurrency", type=int, default=None,
                                help="τ² tasks: episodes at once (default: 64 on vLLM, 16 lock-step, 1 the oracle)")

    def play(self, tasks, n, engine, spec, *, round_=0, policy=""):
        from common.envs.tau2 import tau2
        if self.user is None:
            raise RecordError(f"{self.source}: no user simulator given (a tau2.User, or 'scripted')")
        with tau2.user_simulator(self.user, self.user_log, [self.domain]) as (user_sim, ready):
            ready()  # a served user model is up and, on a domain whose user has tools, calls them
            return tau2.rollouts(self.tau2, self.domain, [t["tau2"] for t in tasks], n, engine, spec, user_sim,
                                 round_=round_, policy=policy, max_steps=self.max_steps)

    def diagnose(self, task, rollout):
        from common.envs.tau2 import diagnose
        return diagnose.diagnose(self.tau2, self.domain, task["tau2"], rollout)

    @staticmethod
    def cut_stops(short_context):
        """The user simulator's error, and a context shorter than evaluation's, are not the policy's failure;
        τ²'s step and error limits and the agent's own errors are."""
        return {"user_error"} | ({"context_limit"} if short_context else set())

    def evaluate(self, out, policy, spec, engine, *, limit=None, trials=None, concurrency=None):
        """Score `policy` on these tasks (evaluate.py --tasks tau2...) with tau2.evaluate."""
        from common.envs.tau2 import tau2
        return tau2.evaluate(self, out, policy, spec, engine, limit, trials or self.trials,
                             concurrency or self.concurrency)

    # a run's settings (common/presets.py; standard library only)

    @classmethod
    def preset(cls, p, changes):
        """ENV=tau2:DOMAIN: its user simulator checked (GPU presets need one), MAX_LEN, the tiny limits."""
        import re

        from common.presets import PresetError
        if not re.fullmatch(r"tau2:\w+", p.env):
            raise PresetError(f"ENV={p.env}: use bfcl or tau2:DOMAIN (a τ²-bench domain, e.g. tau2:airline)")
        if not cls._user_args(p) and p.gpu_mem_gib:
            raise PresetError(f"ENV={p.env} needs a user simulator: --set USER_MODEL=DIR (served beside the "
                              "policy), or --set USER_BASE_URL=URL --set USER_MODEL_NAME=NAME")
        if "tau2" in p.ood.split():
            raise PresetError(f"OOD=tau2 scores the τ² domains, the one this run trains on (ENV={p.env}) among "
                              "them: use --set OOD=\"bfcl-heldin bfcl-memory\" (BFCL held-in out of distribution)")
        out = {"train_limit": str(cls.TINY_TASKS), "max_new": str(cls.TINY_MAX_NEW)} if p.model == "offline-tiny" else {}
        if p.gpu_mem_gib and int(p.max_len) < cls.MAX_LEN:
            out["max_len"] = str(cls.MAX_LEN)
        return {f: v for f, v in out.items() if f not in changes}

    @staticmethod
    def _user_args(p):
        """Flags of USER_MODEL (served by the stage) or USER_BASE_URL and USER_MODEL_NAME; [] for none."""
        from common.presets import PresetError
        if p.user_model and (p.user_base_url or p.user_model_name):
            raise PresetError("USER_MODEL, or USER_BASE_URL with USER_MODEL_NAME: one user simulator")
        if bool(p.user_base_url) != bool(p.user_model_name):
            raise PresetError("USER_BASE_URL and USER_MODEL_NAME go together")
        if p.user_model:
            from common.train.memplan import user_serve_args
            serve = ["--user-serve-args", user_serve_args(p.max_len)] if p.gpu_mem_gib else []
            return ["--user-model", p.user_model, "--user-tool-parser", p.user_tool_parser,
                    "--user-timeout", p.user_timeout, *serve]
        if p.user_base_url:
            return ["--user-base-url", p.user_base_url, "--user-model-name", p.user_model_name,
                    "--user-timeout", p.user_timeout]
        return []

    @classmethod
    def play_args(cls, p):
        return cls._user_args(p) or ["--scripted-user"]  # on CPU without one, the scripted ScenarioUser

    @classmethod
    def eval_args(cls, p, tasks):
        """The run's own test split may play the scripted user (CPU); τ²-bench as an OOD bench needs a model."""
        from common.presets import PresetError
        user = cls._user_args(p)
        if not user and not tasks.startswith(p.env + ":"):
            raise PresetError(f"OOD {tasks} needs a user simulator: --set USER_MODEL=DIR (served with vllm serve), "
                              "or --set USER_BASE_URL=URL --set USER_MODEL_NAME=NAME")
        return ["--trials", p.tau_k, *(user or ["--scripted-user"])]

    @staticmethod
    def tiny(setting, args):
        from common.envs.tau2 import tiny
        return tiny.WarmStart(setting, args)

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
    def compare_columns(scores):  # the domains of τ²'s scores
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
