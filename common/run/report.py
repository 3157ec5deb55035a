"""A run's report: runs/NAME/report.md and PNG plots, rebuilt from the artifacts at any moment of a live run;
and runs side by side (compare, for evaluate.py --compare).

    python -m common.run.report runs/NAME
"""

import os
import sys

from common.envs import KINDS, kind_of
from common.jsonl import RecordError, atomic_open, read_json
from common.presets import RESEARCH_MODES
from common.run.runs import STAGES, Run, optional_json, optional_jsonl, round_rho
from common.run.view import mean
from common.seal.taxonomy import LABELS, profile


def collect(path):
    """Per-round facts of a run, from whatever artifacts exist so far."""
    run, rounds = Run(path), []
    for t, folder in run.rounds():
        diag = optional_jsonl(os.path.join(folder, "diagnoses.jsonl"))
        omega = optional_json(os.path.join(folder, "interface.json"))
        if not diag:  # Ω of the next round exists before its rollouts
            continue
        labels, cats = [z for d in diag for z in d["turn_labels"]], {d.get("category") for d in diag}
        metrics = optional_jsonl(os.path.join(folder, "train_metrics.jsonl"))
        summary = optional_json(os.path.join(folder, "rollout_summary.json")) or {}
        rho, adapted = round_rho(metrics, omega)
        stepped = [m for m in metrics if m["step"] > 0]
        rounds.append({
            "round": t, "reward": mean([d["reward"] for d in diag]),
            "reward_by_category": {c: mean([d["reward"] for d in diag if d.get("category") == c])
                                   for c in kind_of(run.env).columns(run.env) if c in cats},
            "label_share": profile(labels) if labels else {},
            "omega": omega, "rho": rho, "rho_adapted": adapted, "w_mean": mean([m["w_mean"] for m in metrics]),
            # the policy's entropy (collapse shows here); turn credit's mean turn weight and A < 0 tokens zeroed
            "entropy": mean([m.get("entropy") for m in stepped]), "steps": len(stepped),
            "turn_w_mean": mean([m.get("turn_w_mean") for m in stepped]),
            "turn_zeroed_share": mean([m.get("turn_zeroed_share") for m in stepped]),
            "global_step": max((m.get("global_step", 0) for m in metrics), default=0),
            "summary": summary, "seconds": run.seconds(t),
        })
    evals = {f"round_{t:03d}": scores for t, scores in run.evals()}
    return rounds, evals, run.base_eval(), run.config


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


def plots(run, rounds, evals, base, config):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = config.get("settings", {}).get("env") or "bfcl"
    kind = kind_of(env)
    xs = [r["round"] for r in rounds if r["reward"] is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(xs, [r["reward"] for r in rounds if r["reward"] is not None], "o-", label="all")
    for c in kind.columns(env):
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
    ax.set(title=kind.plot_title(env), xlabel="round")
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
    ax.plot([x for x, _ in ws], [y for _, y in ws], "ko-", lw=2, label="w mean")
    for z in LABELS:  # the ρ each round's weights used (seal-adaptive: the round's own)
        ys = [(r["round"], r["rho"][z]) for r in rounds if r["rho"] and z in r["rho"]]
        ax.plot([x for x, _ in ys], [y for _, y in ys], ".--", alpha=0.7, label=f"ρ {z}")
    ax.set(title="diagnosis weight: mean w, and ρ per label", xlabel="round")
    ax.legend(fontsize=6, ncol=2)
    ticks = [r["round"] for r in rounds]
    for ax in axes.flat:
        ax.set_xticks(ticks)
    fig.tight_layout()
    fig.savefig(os.path.join(run, "curves.png"), dpi=90)
    plt.close(fig)


def context_note(s):
    """A line when training's context (MAX_LEN) is shorter than evaluation's (EVAL_LEN, else the model's)."""
    from common.train.memplan import PlanError, load_arch
    try:
        train = int(s.get("max_model_len") or 0)
        evaluation = int(s.get("eval_len") or 0) or load_arch(s["model"]).max_pos
    except (PlanError, KeyError, OSError, ValueError, TypeError):
        return []
    if not train or not evaluation or train >= evaluation:
        return []
    return [f"Training context {train:,} tokens (MAX_LEN), evaluation's {evaluation:,}: a rollout that fills "
            "the training context ends as `context_limit` where evaluation would have gone on.", ""]


def markdown(run, rounds, evals, base, config):
    s = config.get("settings", {})
    turned = bool(s.get("turn_credit"))  # seal-turn: the turn weights' columns
    lines = [f"# SEAL run `{os.path.basename(run.rstrip('/'))}`", "",
             f"preset **{s.get('preset')}**, mode **{s.get('mode')}**, model `{s.get('model')}`, "
             f"commit `{(config.get('git_commit') or '?')[:10]}`", "", *context_note(s), "![curves](curves.png)", "",
             "## Rounds", "",
             "| round | reward | w mean | " + ("turn w mean | A<0 tokens zeroed | " if turned else "")
             + "entropy | opt. steps (global) | Ω cues | gen tokens | cue tokens | "
             + " | ".join(f"{x} s" for x in STAGES) + " |",
             "|" + "---|" * (8 + 2 * turned + len(STAGES))]
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else "-"

    for r in rounds:
        sm = r["summary"]
        turn = f"{fmt(r['turn_w_mean'])} | {fmt(r['turn_zeroed_share'])} | " if turned else ""
        lines.append(f"| {r['round']} | {fmt(r['reward'])} | {fmt(r['w_mean'])} | {turn}{fmt(r['entropy'])} | "
                     f"{r['steps']} ({r['global_step']}) | "
                     f"{cues_text(r['omega'])} | {sm.get('gen_tokens', '-')} | {sm.get('cue_tokens', '-')} | "
                     + " | ".join(f"{r['seconds'][x]:.1f}" for x in STAGES) + " |")
    if turned:
        lines += ["", "Credit by turn (docs/design.md §6): a model token's advantage is A times its turn's weight; "
                  "where A < 0 a turn verified right weighs 0. `turn w mean`: the mean weight of the turns holding "
                  "model tokens; `A<0 tokens zeroed`: the share of the negative-advantage tokens those turns hold."]
    lines += ["", "## Label mix (share of turns)", "", "| round | " + " | ".join(LABELS) + " |",
              "|" + "---|" * (len(LABELS) + 1)]
    for r in rounds:
        lines.append(f"| {r['round']} | " + " | ".join(f"{r['label_share'].get(z, 0):.2f}" for z in LABELS) + " |")
    lines += ["", "## ρ per label (the utilities of the weight w)", ""]
    if s.get("reweight") == "--no-reweight":
        lines.append(f"Mode {s.get('mode')} trains with w = 1: ρ is not used.")
    else:
        if s.get("adaptive_rho"):
            lines += ["Each round's own ρ_t, from its diagnoses by the mixed-group rule (docs/design.md §6); "
                      "'kept': the rule left the table as it was.", ""]
        lines += ["| round | " + " | ".join(LABELS) + " |", "|" + "---|" * (len(LABELS) + 1)]
        for r in rounds:
            notes = {False: " (kept)", None: " (table: not trained yet)" if s.get("adaptive_rho") else ""}
            rho, note = r["rho"] or {}, notes.get(r["rho_adapted"], "")
            lines.append(f"| {r['round']}{note} | " + " | ".join(fmt(float(rho[z])) if z in rho else "-" for z in LABELS)
                         + " |")
    env = s.get("env") or "bfcl"
    cols = kind_of(env).columns(env)
    first = base or next(iter(evals.values()), None)
    k = (first or {}).get("trials", 1)  # τ²: every task played k times (TAU_K)
    lines += ["", f"## {kind_of(env).eval_title(env, first)}", "",
              "| policy | " + " | ".join(cols) + " | average |" + (f" pass^{k} |" if k > 1 else ""),
              "|" + "---|" * (len(cols) + 2 + (k > 1))]
    for name, sc in ([("base", base)] if base else []) + sorted(evals.items()):
        lines.append(f"| {name} | " + " | ".join(f"{sc.get(c, float('nan')):.2f}" for c in cols)
                     + f" | {sc['average']:.2f} |"
                     + (f" {sc.get('pass_k', {}).get('average', {}).get(str(k), float('nan')):.2f} |" if k > 1 else ""))
    return "\n".join(lines) + "\n"


def compare(paths):
    """Print Table 1 (held-in) with the environments' reference figures, and Table 2 (OOD); Table 1's rows."""
    rows, ood, bases, modes = [], [], set(), {}
    for path in paths:
        if not os.path.isdir(path):
            raise RecordError(f"{path}: no such run folder")
        name = os.path.basename(os.path.normpath(path))
        if os.path.isfile(scores := os.path.join(path, "scores.json")):
            rows.append((name, read_json(scores)))
            continue
        run = Run(path, strict=True)
        if run.base not in bases:
            bases.add(run.base)
            if (scores := run.base_eval()) is not None:
                rows.append((f"{run.preset} base", scores))
            ood.append((f"{run.preset} base", run.base_ood()))
        rows += [(f"{name} r{t:03d}", scores) for t, scores in run.evals()]
        ood += [(f"{name} r{t:03d}", benches) for t, benches in run.ood()]
        modes |= {f"{name} r{t:03d}": run.settings.get("mode") or "?" for t, _ in run.evals() + run.ood()}
    scores = [sc for _, sc in rows]
    refs = [ref for kind in KINDS.values() for ref in kind.references(scores)]  # e.g. the BFCL leaderboard's
    width = max([len(name) for name, _ in rows] + ([len(label) for label, _, _ in refs] or [10]))
    mw = max([len(m) for m in modes.values()] + [len("mode")])
    # each environment's columns its rows hold (a τ²-trained run's: its domain's test split), else the default's
    cols = [c for kind in KINDS.values() for c in kind.compare_columns(scores)] or kind_of("").columns("")
    print(f"{'':{width}}  {'mode':<{mw}}" + "".join(f"{c:>14}" for c in cols + ["average"]))
    for name, sc in rows:
        notes = [f"‡ {modes[name]}: beyond the paper, a research mode no GPU run has tested (docs/design.md §6)"] \
            if modes.get(name) in RESEARCH_MODES else []
        print(f"{name:{width}}  {modes.get(name, '—'):<{mw}}"
              + "".join(f"{sc.get(c, float('nan')):>14.2f}" for c in cols + ["average"])
              + "".join(f"  {n}" for n in notes + [n for kind in KINDS.values() for n in kind.score_notes(sc)]))
    for label, figure, text in refs:
        print(f"{label:{width}}  {'':<{mw}}" + f"{'—':>14}" * len(cols) + f"{figure:>14.2f}  {text}")
    print_ood([(name, benches) for name, benches in ood if benches], modes)
    return rows


# the paper's Table 2: BFCL V4 memory per backend, web search, τ²-bench per domain (and its user simulator)
OOD_COLUMNS = [("bfcl-heldin", "average", "BFCL held-in"), ("bfcl-memory", "memory_kv", "mem kv"), ("bfcl-memory", "memory_vector", "mem vector"),
               ("bfcl-memory", "memory_rec_sum", "mem rec_sum"), ("bfcl-memory", "memory", "memory avg"),
               ("bfcl-web", "web_search", "web search"), ("tau2", "retail", "τ² retail"),
               ("tau2", "airline", "τ² airline"), ("tau2", "telecom", "τ² telecom"), ("tau2", "average", "τ² avg")]


def print_ood(rows, modes):
    """The Table-2 block of the (name, {bench: scores}) rows, each with its mode (`modes`: {name: mode})."""
    if not rows:
        return
    width = max(len(name) for name, _ in rows)
    mw = max([len(modes.get(name, "—")) for name, _ in rows] + [len("mode")])
    print("\nOut of distribution (Table 2): BFCL V4 memory (web search where it ran) and τ²-bench")
    print(f"{'':{width}}  {'mode':<{mw}}" + "".join(f"{label:>13}" for _, _, label in OOD_COLUMNS)
          + "  τ² user simulator")
    for name, benches in rows:
        cells = []
        for bench, key, _ in OOD_COLUMNS:
            v = benches.get(bench, {}).get(key)
            cells.append(f"{v:>13.2f}" if isinstance(v, (int, float)) else f"{'—' if v is None else v:>13}")
        sim = benches.get("tau2", {}).get("user_simulator") or {}
        print(f"{name:{width}}  {modes.get(name, '—'):<{mw}}" + "".join(cells) + f"  {sim.get('model') or sim.get('name') or sim.get('kind', '—')}")


def main(run):
    rounds, evals, base, config = collect(run)
    plots(run, rounds, evals, base, config)
    text = markdown(run, rounds, evals, base, config)
    with atomic_open(os.path.join(run, "report.md")) as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    main(sys.argv[1])
