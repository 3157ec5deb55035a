"""A run folder as loop.sh leaves it, read one way by the report, the trackers and `evaluate.py --compare`.

    run = Run("runs/NAME")        # its config.json (settings), timing.jsonl and base-<preset> folder
    run.rounds()                  # [(t, runs/NAME/round_XXX)]
    run.seconds(t)                # {stage: seconds} of round t, for every stage of STAGES
    run.evals()                   # [(t, scores)] of runs/NAME/eval/round_XXX/scores.json
    run.ood()                     # [(t, {bench: scores})] of runs/NAME/ood/round_XXX/<bench>/scores.json
    run.base_eval(), run.base_ood()   # the base model's, shared by every run of the preset
    round_rho(metrics, omega)     # the ρ a round's weights used, and whether the adaptive rule moved it

A live run lacks the artifacts of the stages not run yet: absent is empty (None, [] or {}), not an error.
"""

import glob
import os
import re

from common.jsonl import RecordError, read_json, read_jsonl
from common.presets import OOD_BENCHES
from common.run.runinfo import base_dir

# timing.jsonl's stages, in a round's order (a round's eval scores the policy it trained)
STAGES = ("interface", "rollout", "diagnose", "evolve", "train", "eval")
ROUND = "round_[0-9][0-9][0-9]"


def optional_json(path):
    return read_json(path) if os.path.isfile(path) else None


def optional_jsonl(path):
    return read_jsonl(path) if os.path.isfile(path) else []


def round_rho(metrics, omega):
    """(ρ, adapted) of a round: the ρ_t its train metrics record (--adaptive-rho; adapted: whether
    the rule moved it), else its interface's table (adapted None); (None, None) when neither has one."""
    recorded = next((m for m in metrics if isinstance(m.get("rho"), dict)), None)
    if recorded:
        return recorded["rho"], bool(recorded.get("rho_adapted"))
    return ((omega or {}).get("rho") or None), None


def _numbered(run, *pattern):
    """(t, path) of what run/*pattern matches, t read from its round_XXX part, in order."""
    paths = glob.glob(os.path.join(run, *pattern))
    return sorted((int(re.search(r"round_(\d+)", os.path.relpath(p, run))[1]), p) for p in paths)


def _benches(folder):
    return {b: read_json(p) for b in OOD_BENCHES if os.path.isfile(p := os.path.join(folder, b, "scores.json"))}


class Run:
    """A run folder; with `strict`, one whose config.json must exist (a run loop.sh started)."""

    def __init__(self, path, strict=False):
        self.path = path
        config = os.path.join(path, "config.json")
        if strict and not os.path.isfile(config):
            raise RecordError(f"{path}: not a run folder (no config.json)")
        self.config = optional_json(config) or {}
        self.settings = self.config.get("settings", {})
        self.preset = self.settings.get("preset")
        self.env = self.settings.get("env") or "bfcl"
        self.base = base_dir(path, self.preset, self.env)
        self.timing = optional_jsonl(os.path.join(path, "timing.jsonl"))

    def rounds(self):
        return _numbered(self.path, ROUND)

    def seconds(self, t):
        return {s: sum(x["seconds"] for x in self.timing if x["round"] == t and x["stage"] == s) for s in STAGES}

    def evals(self):
        return [(t, read_json(p)) for t, p in _numbered(self.path, "eval", ROUND, "scores.json")]

    def ood(self):
        return [(t, _benches(d)) for t, d in _numbered(self.path, "ood", ROUND)]

    def base_eval(self):
        return optional_json(os.path.join(self.base, "eval", "scores.json"))

    def base_ood(self):
        return _benches(os.path.join(self.base, "ood"))
