"""The environments: a stage's `--tasks` and a run's ENV name one; KINDS is every kind (docs/environments.md).

A kind is a class; the stages, loop.sh (through common/presets.py), the tiny build and the views ask it and
never test which it is. Required: __init__(source), play, diagnose, cut_stops, CHECKS_TURNS, evaluate and the
views (columns, view_categories, eval_title, plot_title, eval_tasks, view_tasks, task_view, compare_columns,
score_notes, references). Optional, with the defaults below: preset, play_args, eval_args (a run's settings,
standard library only: they run before setup.sh), add_args and from_args (its stage flags), tiny (the tiny
model's warm start).
"""

from common.envs.bfcl import BFCL
from common.envs.mcp import MCP
from common.envs.tau2 import Tau2Env
from common.jsonl import RecordError

KINDS = {"bfcl": BFCL, "tau2": Tau2Env, "mcp": MCP}  # a run's ENV is KIND or KIND:..., its --tasks too


def kind_of(setting):
    """The class of a run's ENV, a `--tasks` value or a record's "env": the kind before the first colon; a
    BFCL task file, a BFCL bench (bfcl-memory) or nothing is BFCL."""
    return KINDS.get((setting or "").split(":", 1)[0], BFCL)


def add_args(parser, evaluation=False):
    """Every kind's own flags on a stage's parser (`evaluation`: evaluate.py's); load refuses those of a kind
    other than the tasks'."""
    parser.kind_flags = {}
    for name, kind in KINDS.items():
        before = list(parser._actions)
        if hasattr(kind, "add_args"):
            kind.add_args(parser.add_argument_group(f"{name} tasks"), evaluation)
        parser.kind_flags[name] = [a for a in parser._actions if a not in before]


def load(tasks, args=None, parser=None, evaluation=False, **settings):
    """The environment of `--tasks`: from a stage's parsed flags (`args`, `parser` after add_args), or built
    with the kind's own `settings` (a τ² user: `user="scripted"`)."""
    kind = kind_of(tasks)
    if parser is None:
        return kind(tasks, **settings)
    for name, actions in parser.kind_flags.items():
        given = [a.option_strings[0] for a in actions if KINDS[name] is not kind and getattr(args, a.dest) != a.default]
        if given:
            parser.error(f"{', '.join(given)}: for {name} tasks, not {tasks or 'BFCL held-in'}")
    return kind.from_args(tasks, args, parser, evaluation) if hasattr(kind, "from_args") else kind(tasks)


def cut_stops(record, short_context):
    """The `stop` values that cut a rollout record of its environment from the loss (train_grpo.py --cut mask):
    ends that are not the policy's failure under evaluation's rules. `short_context`: the rollouts' context is
    shorter than evaluation's, so that a context limit is training's own."""
    return kind_of(record.get("env")).cut_stops(short_context)


def checks_turns(record):
    """Whether the record's environment verifies every user turn on its own (BFCL's checkers after each turn),
    so that turn credit may trust a turn labelled pass, or judges the episode once (τ²)."""
    return kind_of(record.get("env")).CHECKS_TURNS


# ----------------------------------------------------------------------------- a run's settings (stdlib only)
def preset(p, changes):
    """ENV's kind's changes to the resolved preset `p` ({field: value}; `changes`: the --set fields, which
    it leaves alone); it refuses a setting it cannot run with (common.presets.PresetError)."""
    kind = kind_of(p.env)
    return kind.preset(p, changes) if hasattr(kind, "preset") else {}


def play_args(p):
    """rollout.py's flags for ENV's tasks under `p` (τ²: its user simulator)."""
    kind = kind_of(p.env)
    return kind.play_args(p) if hasattr(kind, "play_args") else []


def eval_args(p, tasks):
    """evaluate.py's flags for `tasks` (the run's evaluation, or an OOD bench) under `p`."""
    kind = kind_of(tasks)
    return kind.eval_args(p, tasks) if hasattr(kind, "eval_args") else []


def tiny(setting, args):
    """The tiny model's warm start on ENV=`setting` (common/run/tiny.py, the build's `args`)."""
    kind = kind_of(setting)
    if not hasattr(kind, "tiny"):
        raise RecordError(f"ENV={setting}: this environment has no tiny model's warm start")
    return kind.tiny(setting, args)
