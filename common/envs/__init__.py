"""The environment a stage plays and judges: `--tasks` names it.

    --tasks data/train.jsonl       BFCL V3 multi-turn: bfcl-eval's classes and checker (common/envs/bfcl/harness.py)
    --tasks tau2:airline:train     a τ²-bench domain's split: τ²'s orchestrator, user simulator and
                                   evaluator (common/envs/tau2/tau2.py); any domain in τ²'s registry

What the stages need of an environment is four things, and nothing else differs between them:

    env.categories                       what scores and summaries are grouped by, in order
    env.tasks                            the tasks by id: dicts with "id" and "category"
    env.play(tasks, n, engine, spec, round_=, policy=)   rollout records (docs/design.md §3)
    env.diagnose(task, rollout)          a diagnosis record: the environment's own reward, a
                                         label per user turn (common/seal/taxonomy.py), the profile

and, for training, which ends of its episodes are not the policy's failure under evaluation's rules
(train_grpo.py --cut mask leaves them out of the loss): cut_stops(record, short_context) below; and
whether its checker judges each user turn on its own (checks_turns(record): turn credit clears a
turn labelled pass only where the checker verified it at that turn, docs/design.md §6).

For the views (common/run/report.py, common/run/view.py, common/run/tracking.py), each class answers for a
run's `env` setting (KIND or KIND:DOMAIN; KINDS below, kind_of) without loading anything else:
columns(env) and view_categories(env), the evaluation's score columns and the viewer's categories;
eval_title(env, scores) and plot_title(env); eval_tasks(env) and view_tasks(source), the tasks whose
task_view(task) the viewer and trackers show beside the plays (τ²'s: none, its records carry the user
turns); and, across runs, compare_columns(scores), score_notes(sc) and references(scores).

A new environment is one more class here, its line in KINDS, and the module that plays it; the stages
do not change.
"""

from common.envs.bfcl import BFCL
from common.envs.tau2 import TAU2, Tau2Env
from common.jsonl import RecordError


def is_tau2(tasks):
    return tasks.startswith(TAU2)


def load(tasks, user=None, user_log=None, max_steps=None):
    """The environment of `--tasks` (a BFCL task file, or tau2:DOMAIN:SPLIT). A τ² episode's
    settings: `user`, its user simulator ("scripted", common/envs/tau2/tau2.py ScenarioUser, or a tau2.User,
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


KINDS = {"bfcl": BFCL, "tau2": Tau2Env}  # the environment kinds: a run's `env` setting is KIND or KIND:DOMAIN


def kind_of(setting):
    """The environment class of a run's `env` setting ("bfcl", "tau2:DOMAIN"), a `--tasks` value or a
    record's "env": the kind before the first colon; a BFCL task file, or nothing, is BFCL."""
    return KINDS.get((setting or "").split(":", 1)[0], BFCL)
