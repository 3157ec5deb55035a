"""A run's report: runs/NAME/report.md and PNG plots, rebuilt from the artifacts.

    python -m common.report runs/NAME

Reads only what the stages wrote (diagnoses, interfaces, train metrics, rollout
summaries, timing, evaluation scores), so it can run at any moment of a live
run; loop.sh calls it after every round.
"""

import glob
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common.bfcl import CATEGORIES  # noqa: E402
from common.jsonl import atomic_open, read_json, read_jsonl  # noqa: E402
from common.runinfo import base_dir  # noqa: E402
from common.taxonomy import LABELS  # noqa: E402

STAGES = ["interface", "rollout", "diagnose", "evolve", "train", "eval"]


# A live run lacks the artifacts of stages that have not run yet: absent is empty, not an error.
def _json(path):
    return read_json(path) if os.path.isfile(path) else None


def _jsonl(path):
    return read_jsonl(path) if os.path.isfile(path) else []


def collect(run):
    """Per-round facts of a run, from whatever artifacts exist so far."""
    rounds = []
    timing = _jsonl(os.path.join(run, "timing.jsonl"))
    for folder in sorted(glob.glob(os.path.join(run, "round_[0-9][0-9][0-9]"))):
        t = int(folder[-3:])
        diag = _jsonl(os.path.join(folder, "diagnoses.jsonl"))
        omega = _json(os.path.join(folder, "interface.json"))
        if not diag:  # Ω of the next round exists before its rollouts
            continue
        labels = [z for d in diag for z in d["turn_labels"]]
        metrics = _jsonl(os.path.join(folder, "train_metrics.jsonl"))
        summary = _json(os.path.join(folder, "rollout_summary.json")) or {}
        row = {
            "round": t,
            "reward": sum(d["reward"] for d in diag) / len(diag) if diag else None,
            "reward_by_category": {c: sum(d["reward"] for d in diag if d.get("category") == c)
                                   / max(1, sum(d.get("category") == c for d in diag))
                                   for c in CATEGORIES if any(d.get("category") == c for d in diag)},
            "label_share": {z: labels.count(z) / len(labels) for z in LABELS} if labels else {},
            "omega": omega,
            "w_mean": (sum(m["w_mean"] for m in metrics) / len(metrics)) if metrics else None,
            "steps": sum(m["step"] > 0 for m in metrics),
            "global_step": max((m.get("global_step", 0) for m in metrics), default=0),
            "summary": summary,
            "seconds": {s: sum(x["seconds"] for x in timing if x["round"] == t and x["stage"] == s) for s in STAGES},
        }
        rounds.append(row)
    evals = {}
    for path in sorted(glob.glob(os.path.join(run, "eval", "*", "scores.json"))):
        evals[os.path.basename(os.path.dirname(path))] = _json(path)
    config = _json(os.path.join(run, "config.json")) or {}
    preset = config.get("settings", {}).get("preset")
    base = _json(os.path.join(base_dir(run, preset), "eval", "scores.json"))
    return rounds, evals, base, config


def cues_text(omega):
    if not omega:
        return "-"
    on = []
    if omega.get("schema_cue", {}).get("enabled"):
        on.append("schema")
    if omega.get("error_feedback"):
        on.append("error")
    on += [f"cap:{c['label']}" for c in omega.get("capability_cues", [])]
    return ", ".join(on) or "none"


def plots(run, rounds, evals, base):
    xs = [r["round"] for r in rounds if r["reward"] is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(xs, [r["reward"] for r in rounds if r["reward"] is not None], "o-", label="all")
    for c in CATEGORIES:
        ys = [r["reward_by_category"].get(c) for r in rounds if r["reward"] is not None]
        if any(y is not None for y in ys):
            ax.plot(xs, ys, ".--", alpha=0.6, label=c)
    ax.set(title="training reward (official verdict)", xlabel="round", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    ax = axes[0][1]
    ev = sorted((int(k.split("_")[1]), v["average"]) for k, v in evals.items() if k.startswith("round_"))
    if ev:
        ax.plot([x for x, _ in ev], [y for _, y in ev], "o-", label="policy")
    if base:
        ax.axhline(base["average"], color="gray", ls=":", label="base")
    ax.set(title="held-in score (average, %)", xlabel="round")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    bottom = [0.0] * len(rounds)
    for z in LABELS:
        ys = [r["label_share"].get(z, 0.0) for r in rounds]
        ax.bar([r["round"] for r in rounds], ys, bottom=bottom, label=z)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set(title="turn labels (share)", xlabel="round")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    ws = [(r["round"], r["w_mean"]) for r in rounds if r["w_mean"] is not None]
    ax.plot([x for x, _ in ws], [y for _, y in ws], "o-")
    ax.set(title="mean diagnosis weight w", xlabel="round")
    ticks = [r["round"] for r in rounds]
    for ax in axes.flat:
        ax.set_xticks(ticks)
    fig.tight_layout()
    fig.savefig(os.path.join(run, "curves.png"), dpi=90)
    plt.close(fig)


def markdown(run, rounds, evals, base, config):
    s = config.get("settings", {})
    lines = [f"# SEAL run `{os.path.basename(run.rstrip('/'))}`", "",
             f"preset **{s.get('preset')}**, mode **{s.get('mode')}**, model `{s.get('model')}`, "
             f"commit `{(config.get('git_commit') or '?')[:10]}`", "", "![curves](curves.png)", "",
             "## Rounds", "",
             "| round | reward | w mean | opt. steps (global) | Ω cues | gen tokens | cue tokens | "
             + " | ".join(f"{x} s" for x in STAGES) + " |",
             "|" + "---|" * (7 + len(STAGES))]
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else "-"

    for r in rounds:
        sm = r["summary"]
        lines.append(f"| {r['round']} | {fmt(r['reward'])} | {fmt(r['w_mean'])} | {r['steps']} ({r['global_step']}) | "
                     f"{cues_text(r['omega'])} | {sm.get('gen_tokens', '-')} | {sm.get('cue_tokens', '-')} | "
                     + " | ".join(f"{r['seconds'][x]:.1f}" for x in STAGES) + " |")
    lines += ["", "## Label mix (share of turns)", "", "| round | " + " | ".join(LABELS) + " |",
              "|" + "---|" * (len(LABELS) + 1)]
    for r in rounds:
        lines.append(f"| {r['round']} | " + " | ".join(f"{r['label_share'].get(z, 0):.2f}" for z in LABELS) + " |")
    lines += ["", "## Held-in (BFCL multi-turn @ bfcl-eval 2026.3.23, %)", "",
              "| policy | " + " | ".join(CATEGORIES) + " | average |", "|" + "---|" * (len(CATEGORIES) + 2)]
    for name, sc in ([("base", base)] if base else []) + sorted(evals.items()):
        lines.append(f"| {name} | " + " | ".join(f"{sc.get(c, float('nan')):.2f}" for c in CATEGORIES)
                     + f" | {sc['average']:.2f} |")
    return "\n".join(lines) + "\n"


def main(run):
    rounds, evals, base, config = collect(run)
    plots(run, rounds, evals, base)
    text = markdown(run, rounds, evals, base, config)
    with atomic_open(os.path.join(run, "report.md")) as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    main(sys.argv[1])
