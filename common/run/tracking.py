"""A run's figures in experiment trackers, through Accelerate's own (TensorBoard, W&B, Trackio, MLflow, ...).

    python -m common.run.tracking runs/NAME --report-to tensorboard,wandb   # log what is new (docs/tracking.md)
    python -m common.run.tracking --check tensorboard,wandb                  # exit 2 naming a missing one
"""

import argparse
import importlib.util
import math
import os
import sys
import uuid

from common.jsonl import read_json, read_jsonl, write_json
from common.run.runs import Run, round_rho
from common.run.view import joined, mask_runs, mean
from common.seal.interface import FAILURE_LABELS
from common.seal.taxonomy import LABELS

PROJECT = "seal"  # W&B / Comet / Trackio project, MLflow experiment, TensorBoard folder name
TABLE_ROWS = 16  # a round's trajectories of largest |w·A| (TRL's completions table, plus SEAL's labels and w)
TABLE_COLUMNS = ["task_id", "sample", "category", "prompt", "completion", "reward", "advantage", "w", "w_advantage",
                 "turn_labels"]
# Accelerate's tracker name -> the package to install; a name it does not know is refused.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "comet_ml": "comet-ml",
            "mlflow": "mlflow", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab"}


def parse(report_to):
    """The tracker names of a REPORT_TO value ("none" or empty: none; "all": every installed one)."""
    names = [n.strip() for n in (report_to or "").split(",") if n.strip() and n.strip() != "none"]
    bad = [n for n in names if n != "all" and n not in PACKAGES]
    if bad:
        raise ValueError(f"REPORT_TO: unknown tracker {bad[0]!r}; choices: all, none, {', '.join(PACKAGES)}")
    return [n for n in PACKAGES if installed(n)] if "all" in names else list(dict.fromkeys(names))


def installed(name):
    # find_spec of a top-level name imports nothing (torch.utils.tensorboard would import torch)
    return importlib.util.find_spec(name) is not None


def check(report_to):
    """None if every named tracker is importable, else the message saying how to install them."""
    missing = [n for n in parse(report_to) if not installed(n)]
    if missing:
        pkgs = " ".join(PACKAGES[n] for n in missing)
        return f"REPORT_TO={report_to}: {', '.join(missing)} not installed; install with: .venv/bin/python -m pip install {pkgs}"
    return None


# ----------------------------------------------------------------------------- figures
def _std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) if xs else None


def rollout_figures(rollouts, max_new_tokens):
    steps = [s for r in rollouts for turn in r["turns"] for s in turn["steps"]]
    calls = [len(s["calls"]) for s in steps]
    errors = [e for s in steps for e in s["call_errors"]]
    outputs = [n for r in rollouts for seg in [r["tokens"], *r["tokens"].get("segments", [])]
               for m, n in mask_runs(seg["mask"]) if m]  # one run of 1s per model output
    gen = [r["stats"]["gen_tokens"] for r in rollouts]
    figs = {
        "response_length/mean": mean(gen), "response_length/max": max(gen),
        "response_length/clip_ratio": (sum(n >= max_new_tokens for n in outputs) / len(outputs)
                                       if outputs and max_new_tokens else None),
        "prompt_length/mean": mean([len(r["tokens"]["prompt_ids"]) for r in rollouts]),
        "num_turns/mean": mean([len(r["turns"]) for r in rollouts]), "num_turns/max": max(len(r["turns"]) for r in rollouts),
        "rollout/steps/mean": mean([sum(len(t["steps"]) for t in r["turns"]) for r in rollouts]),
        "rollout/steps/max": max(sum(len(t["steps"]) for t in r["turns"]) for r in rollouts),
        "tools/calls_per_step": mean(calls), "tools/call_frequency": sum(calls) / len(rollouts),
        "tools/failure_frequency": sum(e is not None for e in errors) / len(errors) if errors else 0.0,
        "rollout/parse_error_rate": sum(s["parse_error"] is not None for s in steps) / len(steps) if steps else 0.0,
        "seal/cue_tokens/mean": mean([r["stats"]["cue_tokens"] for r in rollouts]),
    }
    for stop in sorted({r["stop"] for r in rollouts}):
        figs[f"rollout/stop/{stop}"] = sum(r["stop"] == stop for r in rollouts) / len(rollouts)
    return figs


def reward_figures(diagnoses):
    groups = {}
    for d in diagnoses:
        groups.setdefault(d["task_id"], []).append(d)
    figs = {"critic/score/mean": mean([d["reward"] for d in diagnoses]),
            "reward_std": mean([_std([d["reward"] for d in g]) for g in groups.values()]),
            "frac_reward_zero_std": sum(len({d["reward"] for d in g}) == 1 for g in groups.values()) / len(groups)}
    for c in dict.fromkeys(d["category"] for d in diagnoses):  # BFCL's categories, or a τ² domain
        cat = [g for g in groups.values() if g[0]["category"] == c]
        if cat:
            figs[f"reward/{c}/mean"] = mean([d["reward"] for g in cat for d in g])
            figs[f"reward/{c}/pass_at_n"] = sum(any(d["reward"] == 1 for d in g) for g in cat) / len(cat)
    labels = [z for d in diagnoses for z in d["turn_labels"]]
    figs |= {f"seal/label/{z}": labels.count(z) / len(labels) for z in LABELS} if labels else {}
    return figs


def omega_figures(omega):
    on = {c["label"] for c in omega.get("capability_cues", [])}
    figs = {"seal/cue/schema": float(omega["schema_cue"]["enabled"]),
            "seal/cue/error_feedback": float(omega["error_feedback"]), "seal/cue/capability": float(len(on))}
    return figs | {f"seal/cue/capability/{z}": float(z in on) for z in FAILURE_LABELS}


def train_figures(metrics):
    stepped = [m for m in metrics if m["step"] > 0]
    figs = {"training/global_step": max(m["global_step"] for m in metrics), "training/optimizer_steps": len(stepped),
            "seal/w/mean": mean([m["w_mean"] for m in metrics]), "seal/w/std": mean([m["w_std"] for m in metrics])}
    names = {"loss": "actor/loss", "pg_loss": "actor/pg_loss", "kl": "actor/kl_loss", "clip_frac": "actor/pg_clipfrac",
             "dual_clip_frac": "actor/pg_clipfrac_lower", "grad_norm": "actor/grad_norm", "lr": "actor/lr",
             "wa_mean": "seal/wa/mean", "unplayed_share": "seal/unplayed_share", "entropy": "actor/entropy",
             "logprob_mismatch": "sampling/sampling_logp_difference/mean", "tokens_per_s": "perf/throughput",
             "is_ratio_mean": "sampling/importance_sampling_ratio/mean", "cut_share": "seal/cut_share",
             "turn_w_mean": "seal/turn/w_mean", "turn_zeroed_share": "seal/turn/zeroed_share"}
    # the rollout correction's shares under verl's names: truncated IS's ratios above the cap, masked IS's drops
    masked = any(str((m.get("objective") or {}).get("rollout_is", "")).endswith("mask") for m in stepped)
    names |= {"rollout_is_frac": "rollout_corr/rollout_rs_masked_fraction" if masked
              else "rollout_corr/rollout_is_ratio_fraction_high",
              "rollout_is_seq_frac": "rollout_corr/rollout_rs_seq_masked_fraction" if masked
              else "rollout_corr/rollout_is_seq_fraction_high"}
    for key, name in names.items():
        value = mean([m.get(key) for m in stepped])
        if value is not None:
            figs[name] = value
    if any(m.get("is_ratio_max") is not None for m in stepped):
        figs["sampling/importance_sampling_ratio/max"] = max(m["is_ratio_max"] for m in stepped
                                                              if m.get("is_ratio_max") is not None)
    return figs


def round_figures(folder, t, seconds, max_new_tokens):
    """Every figure of round t, or None before its train metrics. `seconds`: its stages' times but eval's."""
    metrics_path = os.path.join(folder, "train_metrics.jsonl")
    if not os.path.isfile(metrics_path):
        return None
    rollouts = read_jsonl(os.path.join(folder, "rollouts.jsonl"))
    figs = {"training/round": t}
    figs |= rollout_figures(rollouts, max_new_tokens)
    figs |= reward_figures(read_jsonl(os.path.join(folder, "diagnoses.jsonl")))
    omega, metrics = read_json(os.path.join(folder, "interface.json")), read_jsonl(metrics_path)
    figs |= omega_figures(omega)
    figs |= train_figures(metrics)
    rho, adapted = round_rho(metrics, omega)  # the ρ the round's weights used (seal-adaptive: its own)
    figs |= {f"seal/rho/{z}": float(v) for z, v in (rho or {}).items()}
    if adapted is not None:
        figs["seal/rho/adapted"] = float(adapted)
    summary_path = os.path.join(folder, "rollout_summary.json")
    if os.path.isfile(summary_path):
        summary = read_json(summary_path)
        figs["rollout/gen_tokens"] = summary["gen_tokens"]
        if summary.get("seconds"):
            figs["perf/gen_throughput"] = summary["gen_tokens"] / summary["seconds"]
        if "cached_share" in summary:
            figs["rollout/prefix_cache_share"] = summary["cached_share"]
    figs |= {f"timing_s/{s}": v for s, v in seconds.items()}
    figs["timing_s/round"] = sum(seconds.values())
    return figs


def trajectory_table(run, folder):
    """Round rows of TABLE_COLUMNS, largest |w·A| first, A and w as train_grpo.py computed them."""
    from common import envs
    rollouts = read_jsonl(os.path.join(folder, "rollouts.jsonl"))
    diagnoses = {(d["task_id"], d["sample_index"]): d for d in read_jsonl(os.path.join(folder, "diagnoses.jsonl"))}
    trained = read_jsonl(os.path.join(folder, "train_metrics.jsonl"))[0]  # the stops it cut, its advantage scale
    trajs = joined(rollouts, list(diagnoses.values()), folder, run.settings, trained)
    # the task's user turns where its records do not hold them (a τ² record does: turns[k].user)
    kind = envs.kind_of(run.env)
    tasks = kind.view_tasks(run.settings.get("tasks") or "data/train.jsonl")
    texts = {(r["task_id"], r["sample_index"]): "\n\n".join(s["text"] for t in r["turns"] for s in t["steps"])
             for r in rollouts}
    users = {(r["task_id"], r["sample_index"]): "\n\n".join(t["user"] for t in r["turns"] if t.get("user"))
             for r in rollouts}
    rows = []
    for j in sorted(trajs, key=lambda j: -abs(j.weight * j.advantage))[:TABLE_ROWS]:
        key = (j.task_id, j.sample_index)
        task = kind.task_view(tasks[j.task_id]) if j.task_id in tasks and not users[key] else {}
        prompt = users[key] or "\n\n".join(m["content"] for q in task.get("questions", []) for m in q)
        rows.append([j.task_id, j.sample_index, diagnoses[key]["category"], prompt, texts[key], j.reward, j.advantage,
                     j.weight, j.weight * j.advantage, " ".join(
                         z if j.turn_weights is None else f"{z}×{v:.2f}"
                         for z, v in zip(diagnoses[key]["turn_labels"], j.turn_weights or diagnoses[key]["turn_labels"],
                                         strict=True))])
    return rows


def table_text(rows):
    """The table in markdown for TensorBoard, completions cut to 200 characters."""
    cell = lambda v: (f"{v:.3f}" if isinstance(v, float) else str(v)).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| task | sample | reward | A | w | w·A | turn labels | completion |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(v) for v in (r[0], r[1], r[5], r[6], r[7], r[8], r[9], r[4][:200])) + " |")
    return "\n".join(lines)


def _scores(prefix, scores):
    """A scores.json's percentages (its top-level numbers; the nested objects say how it was run)."""
    return {f"{prefix}/{k}": v for k, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def units(path):
    """Every complete unit of the run so far: (step, key, figures), in step order."""
    run = Run(path.rstrip("/"), strict=True)
    max_new = int(run.settings["max_new_tokens"]) if run.settings.get("max_new_tokens") else None
    out = []
    if (base := run.base_eval()) is not None:
        out.append((0, "eval base", _scores("val-core/heldin", base)))
    for t, folder in run.rounds():
        seconds = {s: v for s, v in run.seconds(t).items() if s != "eval"}
        if (figs := round_figures(folder, t, seconds, max_new)) is not None:
            out.append((t, f"round {t}", figs))
    for t, scores in run.evals():
        figs = _scores("val-core/heldin", scores)
        # the last: a run that computed the base model's scores also timed that as round 0's eval
        seconds = [x["seconds"] for x in run.timing if x["round"] == t and x["stage"] == "eval"]
        if seconds:
            figs["timing_s/eval"] = seconds[-1]
        out.append((t + 1, f"eval round {t}", figs))
    base_ood = run.base_ood()
    for t, benches in run.ood():
        for bench, scores in benches.items():
            figs = _scores(f"val-core/ood/{bench}", scores)
            if bench in base_ood:
                figs |= _scores(f"val-core/ood-base/{bench}", base_ood[bench])
            out.append((t + 1, f"ood {t} {bench}", figs))
    return sorted(out, key=lambda u: u[0]), run.config


# ----------------------------------------------------------------------------- trackers
def _config(config):
    """config.json flattened to the scalars every tracker takes as hyperparameters."""
    return {**config["settings"], **{f"version/{k}": v for k, v in config.get("versions", {}).items()},
            "git_commit": config.get("git_commit") or "", "python": config.get("python") or ""}


def log(run, report_to):
    """Log every unit not yet logged by each tracker of `report_to`; returns {tracker: [keys logged]}."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    names = parse(report_to)
    if not names:
        return {}
    if msg := check(report_to):
        raise SystemExit(f"error: {msg}")
    folder = os.path.join(run, "tracking")
    state_path = os.path.join(folder, "state.json")
    state = read_json(state_path) if os.path.isfile(state_path) else {"run_id": uuid.uuid4().hex, "logged": {}}
    todo, config = units(run)
    new = {n: [u for u in todo if u[1] not in state["logged"].get(n, [])] for n in names}
    names = [n for n in names if new[n] or n not in state["logged"]]
    if not names:
        return {}
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(os.path.abspath(run))
    run_id = state["run_id"]
    # the same tracker run on every rerun: each tracker's own way of resuming by id
    init_kwargs = {"wandb": {"id": run_id, "resume": "allow", "name": name, "dir": folder},
                   "trackio": {"name": f"{name}-{run_id[:8]}", "resume": "allow"},
                   "comet_ml": {"experiment_key": run_id},
                   "mlflow": {"run_name": name, "run_id": state.get("mlflow_run_id")}}
    logged, tables = {}, {}
    for n in names:  # one Accelerator per tracker: each gets its own new units and config
        acc = Accelerator(cpu=True, log_with=[n], project_config=ProjectConfiguration(project_dir=run, logging_dir=folder))
        first = n not in state["logged"]
        acc.init_trackers(PROJECT, config=_config(config) if first else None,
                          init_kwargs={n: init_kwargs.get(n, {})})
        for step, key, figs in new[n]:
            acc.log({k: v for k, v in figs.items() if v is not None}, step=step)
            if key.startswith("round ") and (n == "tensorboard" or hasattr(acc.get_tracker(n), "log_table")):
                if step not in tables:  # read once for every tracker
                    tables[step] = trajectory_table(Run(run), os.path.join(run, f"round_{step:03d}"))
                rows = tables[step]
                if n == "tensorboard":
                    acc.get_tracker(n, unwrap=True).add_text("seal/trajectories", table_text(rows), global_step=step)
                else:
                    acc.get_tracker(n).log_table("seal/trajectories", columns=TABLE_COLUMNS, data=rows, step=step)
        if n == "mlflow":
            state["mlflow_run_id"] = acc.get_tracker("mlflow").active_run.info.run_id
        acc.end_training()
        # marked once the tracker has flushed and closed: a unit is never marked and lost
        state["logged"][n] = state["logged"].get(n, []) + [key for _, key, _ in new[n]]
        write_json(state_path, state)
        logged[n] = [key for _, key, _ in new[n]]
    return logged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", help="run folder (runs/NAME)")
    ap.add_argument("--report-to", default="none", help="comma-separated trackers, all, or none")
    ap.add_argument("--check", metavar="REPORT_TO", help="only check that these trackers are installed")
    args = ap.parse_args(argv)
    try:
        if args.check is not None:
            if msg := check(args.check):
                print(f"error: {msg}", file=sys.stderr)
                sys.exit(2)
            return
        if not args.run:
            ap.error("a run folder is required")
        for n, keys in log(args.run, args.report_to).items():
            print(f"tracking: {n}: logged {', '.join(keys) or 'nothing new'}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
