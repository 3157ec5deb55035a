"""A run's viewer: every trajectory's turns, calls, verdicts and diagnosis beside its advantage and weight.

    python -m common.run.view runs/NAME [--out DIR]      # default DIR: runs/NAME/viewer

A static page and one data script per round and evaluation, rebuilt when their artifacts change (docs/viewer.md).
"""

import argparse
import glob
import itertools
import json
import os
import shutil
import sys

from common import envs
from common.jsonl import RecordError, atomic_open
from common.run.runs import Run, optional_json, round_rho
from common.seal.taxonomy import LABELS, profile

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "viewer")
FORMAT = 2  # data files of another format are rebuilt


def read_records(path, rel, missing):
    """A JSONL file's records up to its first unreadable line; what is absent or cut goes to `missing`."""
    if not os.path.isfile(path):
        missing.append(f"{rel}: not written")
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict):
                missing.append(f"{rel}:{n}: cut or unreadable; the {len(records)} records before it are shown")
                break
            rec["_line"] = n
            records.append(rec)
    return records


def read_object(path, rel, missing, required=False):
    try:
        obj = optional_json(path)
    except (RecordError, ValueError):
        missing.append(f"{rel}: cut or unreadable")
        return None
    if obj is None and required:
        missing.append(f"{rel}: not written")
    return obj


def mask_runs(mask):
    """The loss mask as [value, length] runs: the k-th run of 1s is the k-th model output."""
    return [[m, len(list(run))] for m, run in itertools.groupby(mask)]


def trajectory(rec):
    """A rollout record as the page shows it: token counts and the mask's runs, not the token lists."""
    out = {k: v for k, v in rec.items() if k not in ("tokens", "_line")}
    tokens = rec.get("tokens") if isinstance(rec.get("tokens"), dict) else {}
    more = tokens.get("segments") if isinstance(tokens.get("segments"), list) else []
    ids = trained = 0
    runs, starts = [], []
    for k, seg in enumerate([tokens, *(s for s in more if isinstance(s, dict))]):
        mask = seg.get("mask") if isinstance(seg.get("mask"), list) else []
        if k:
            runs.append([2, len(seg.get("prompt_ids") or [])])
            starts.append(seg.get("turn"))
        ids += len(seg.get("ids") or [])
        trained += sum(1 for m in mask if m == 1)
        runs += mask_runs(mask)
    out["tokens"] = {"prompt": len(tokens.get("prompt_ids") or []), "ids": ids, "trained": trained, "runs": runs,
                     "rerendered_at": starts}
    return out


def joined(rollouts, diagnoses, folder, settings, trained, **paths):
    """A round's trajectories as train_grpo.py joined them (A and w) under the run's settings."""
    from common.train.grpo import as_trained, join_round, load_rho  # torch: only where a round is built
    interface = os.path.join(folder, "interface.json")
    rho = load_rho(interface if os.path.isfile(interface) else None)
    return join_round(rollouts, diagnoses, rho, reweight=settings.get("reweight") != "--no-reweight",
                      adaptive=bool(settings.get("adaptive_rho")), turn_credit=bool(settings.get("turn_credit")),
                      checked=envs.checks_turns, **paths, **as_trained(trained))[0]


def advantages(rollouts, diagnoses, folder, rel, settings, trained, missing):
    """{(task_id, sample): (A, w, turn weights or None)} as train_grpo.py computed them, or {} (`missing`)."""
    try:
        trajs = joined(rollouts, diagnoses, folder, settings, trained, rollouts_path=f"{rel}/rollouts.jsonl",
                       diagnoses_path=f"{rel}/diagnoses.jsonl")
    except (RecordError, KeyError, TypeError, ValueError) as e:
        missing.append(f"{rel}: advantages and weights not computed ({e})")
        return {}
    return {(t.task_id, t.sample_index): (t.advantage, t.weight, t.turn_weights) for t in trajs}


def build_round(folder, rel, tasks, task_view, settings):
    """Round data: Ω, one row per trajectory (rollout, diagnosis, A, w), and the views of its tasks."""
    missing = []
    rollouts = read_records(os.path.join(folder, "rollouts.jsonl"), f"{rel}/rollouts.jsonl", missing)
    diagnoses = read_records(os.path.join(folder, "diagnoses.jsonl"), f"{rel}/diagnoses.jsonl", missing)
    omega = read_object(os.path.join(folder, "interface.json"), f"{rel}/interface.json", missing, required=True)
    # the trainer's record of the round (once trained): the stops it cut, its advantage scale
    metrics = os.path.join(folder, "train_metrics.jsonl")
    trained = (read_records(metrics, f"{rel}/train_metrics.jsonl", missing) or [None])[0] \
        if os.path.isfile(metrics) else None
    adv = advantages(rollouts, diagnoses, folder, rel, settings, trained, missing) if rollouts and diagnoses else {}
    stops = set((trained or {}).get("cut_stops") or [])
    rows, by_key = [], {}
    for r in rollouts:
        row = trajectory(r)
        if r.get("stop") in stops:
            row["cut"] = True
        by_key[(r.get("task_id"), r.get("sample_index"))] = row
        rows.append(row)
    for d in diagnoses:
        key = (d.get("task_id"), d.get("sample_index"))
        row = by_key.get(key)
        if row is None:  # a diagnosis whose rollout is not (yet) readable
            row = by_key[key] = {"task_id": key[0], "sample_index": key[1], "category": d.get("category")}
            rows.append(row)
        row["diagnosis"] = {k: v for k, v in d.items() if k != "_line"}
        if key in adv:
            row["A"], row["w"], turn_w = adv[key]
            if turn_w is not None:
                row["turn_w"] = turn_w
    ids = {row["task_id"] for row in rows}
    return {"round": rel, "omega": omega, "rows": rows, "missing": missing,
            "tasks": {i: task_view(tasks[i]) for i in ids if i in tasks}}


def build_eval(folder, tag, rel, tasks, task_view):
    """Evaluation data: each task's verdict (results.jsonl) beside its play (rollouts.jsonl)."""
    missing = []
    results = read_records(os.path.join(folder, "results.jsonl"), f"{rel}/results.jsonl", missing)
    rollouts = read_records(os.path.join(folder, "rollouts.jsonl"), f"{rel}/rollouts.jsonl", missing)
    plays = {r.get("task_id"): trajectory(r) for r in rollouts}
    rows = []
    for res in results:
        row = plays.pop(res.get("task_id"), None) or {"task_id": res.get("task_id")}
        row["verdict"] = {k: v for k, v in res.items() if k != "_line"}
        row.setdefault("category", res.get("category"))
        rows.append(row)
    rows += plays.values()  # played, not scored yet
    ids = {row["task_id"] for row in rows}
    return {"tag": tag, "rows": rows, "missing": missing, "tasks": {i: task_view(tasks[i]) for i in ids if i in tasks}}


def round_summary(t, data, metrics, summary, omega, seconds):
    """The run table's row of a round (the report's columns) and its tasks' rewards and labels."""
    diag = [row["diagnosis"] for row in data["rows"] if "diagnosis" in row]
    labels = [z for d in diag for z in d.get("turn_labels") or []]
    rho, adapted = round_rho(metrics, omega)
    return {
        "round": t, "trajectories": len(data["rows"]), "diagnosed": len(diag),
        "reward": mean([d.get("reward") for d in diag]), "w_mean": mean([row.get("w") for row in data["rows"]]),
        "steps": sum(m.get("step", 0) > 0 for m in metrics),
        # turn credit: the round's mean turn weight and share of negative-advantage tokens zeroed (its steps')
        "turn_w_mean": mean([m.get("turn_w_mean") for m in metrics if m.get("step", 0) > 0]),
        "turn_zeroed_share": mean([m.get("turn_zeroed_share") for m in metrics if m.get("step", 0) > 0]),
        "global_step": max((m.get("global_step", 0) for m in metrics), default=None),
        "label_share": profile(labels) if labels else {},
        "omega": omega and {k: omega.get(k) for k in ("version", "schema_cue", "error_feedback", "capability_cues")},
        "rho": rho, "rho_adapted": adapted,
        "gen_tokens": summary.get("gen_tokens"), "cue_tokens": summary.get("cue_tokens"),
        "seconds": seconds, "missing": data["missing"],
        "samples": [[row["task_id"], row.get("sample_index"), row["diagnosis"].get("reward"),
                     row["diagnosis"].get("turn_labels")] for row in data["rows"] if "diagnosis" in row],
    }


def mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


def signature(paths):
    return [FORMAT] + [[os.path.getsize(p), os.stat(p).st_mtime_ns] if os.path.isfile(p) else None for p in paths]


def write_data(out, name, obj):
    """data/NAME.js assigning the object to SEAL_LOADED (browsers refuse fetch() of file:// addresses)."""
    with atomic_open(os.path.join(out, "data", name + ".js")) as f:
        f.write("SEAL_LOADED = ")
        json.dump(obj, f, ensure_ascii=True, separators=(",", ":"))  # ASCII: no U+2028 line breaks inside
        f.write(";\n")


def check_run(path):
    if not os.path.exists(path):
        raise RecordError(f"{path}: no such run folder")
    if not os.path.isdir(path):
        raise RecordError(f"{path}: a file, not a run folder (runs/NAME, as loop.sh writes it)")
    if not (os.path.isfile(os.path.join(path, "config.json")) or glob.glob(os.path.join(path, "round_[0-9]*"))
            or os.path.isdir(os.path.join(path, "eval"))):
        raise RecordError(f"{path}: not a run folder (no config.json, round_XXX/ or eval/; runs/NAME, as loop.sh "
                          "writes it)")


def build(path, out=None):
    """Write the viewer of run `path` into `out` (default path/viewer); returns the page's path."""
    check_run(path)
    out = out or os.path.join(path, "viewer")
    run, missing = Run(path), []
    settings = run.settings
    if not run.config:
        missing.append("config.json: not written (settings unknown)")
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    built_path = os.path.join(out, "data", "built.json")
    built_before = read_object(built_path, "built.json", []) or {}
    built = {}

    def cached(name, inputs, make):
        """The summary of `name`; its data, make()'s (data, summary), rebuilt only when its inputs changed."""
        sig = signature(inputs)
        old = built_before.get(name)
        if old and old["signature"] == sig and os.path.isfile(os.path.join(out, "data", name + ".js")):
            built[name] = old
            return old["summary"]
        data, summary = make()
        write_data(out, name, data)
        built[name] = {"signature": sig, "summary": summary}
        return summary

    env = settings.get("env") or "bfcl"
    kind = envs.kind_of(env)  # the environment's views: its categories, task views, evaluation's tasks
    task_files, loaded = {"train": settings.get("tasks") or "data/train.jsonl", "eval": kind.eval_tasks(env)}, {}

    def tasks_for(split):  # (tasks by id, notes): read once, and only when a data file is rebuilt
        if split not in loaded:
            try:
                loaded[split] = kind.view_tasks(task_files[split]), []
            except RecordError as e:
                loaded[split] = {}, [f"task file {e}: user turns and ground truth are not shown"]
        return loaded[split]

    rounds = []
    for t, folder in run.rounds():
        rel = os.path.basename(folder)
        files = [os.path.join(folder, f) for f in ("rollouts.jsonl", "diagnoses.jsonl", "interface.json",
                                                   "train_metrics.jsonl", "rollout_summary.json")]
        if not any(os.path.isfile(f) for f in files[:2]):
            if t < int(settings.get("rounds") or t + 1):  # a finished run's last Ω is no round
                missing.append(f"{rel}: no rollouts yet")
            continue
        notes = []  # the round's train metrics and summary, read at every build (they are small)
        metrics = read_records(os.path.join(folder, "train_metrics.jsonl"), f"{rel}/train_metrics.jsonl", notes)
        summary = read_object(os.path.join(folder, "rollout_summary.json"), f"{rel}/rollout_summary.json", notes) or {}

        def make(folder=folder, rel=rel, t=t, metrics=metrics, summary=summary):
            tasks, notes = tasks_for("train")
            data = build_round(folder, rel, tasks, kind.task_view, settings)
            data["missing"] += notes
            return data, round_summary(t, data, metrics, summary, data["omega"], run.seconds(t))

        row = cached(rel, files + [os.path.join(path, "timing.jsonl")], make)
        missing += row["missing"] + notes
        rounds.append(row)

    evals = []
    for tag, folder in [("base", os.path.join(run.base, "eval"))] + \
            [(os.path.basename(d), d) for d in sorted(glob.glob(os.path.join(path, "eval", "round_[0-9]*")))]:
        if not os.path.isdir(folder):
            continue
        name, rel = f"eval_{tag}", os.path.relpath(folder, os.path.dirname(os.path.abspath(path)))
        scores = read_object(os.path.join(folder, "scores.json"), f"{rel}/scores.json", missing, required=True)

        def make(folder=folder, tag=tag, rel=rel):
            tasks, notes = tasks_for("eval")
            data = build_eval(folder, tag, rel, tasks, kind.task_view)
            data["missing"] += notes
            return data, {"missing": data["missing"]}

        summary = cached(name, [os.path.join(folder, f) for f in ("results.jsonl", "rollouts.jsonl")], make)
        missing += summary["missing"]
        evals.append({"tag": tag, "data": name, "scores": scores})

    ood = [{"tag": f"round_{t:03d}", "benches": benches} for t, benches in run.ood()]
    if run.base_ood():
        ood.insert(0, {"tag": "base", "benches": run.base_ood()})
    parent = os.path.dirname(os.path.abspath(path))
    siblings = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(parent, "*", "config.json"))
                      if not os.path.basename(os.path.dirname(p)).startswith("base-")
                      and os.path.abspath(os.path.dirname(p)) != os.path.abspath(path))
    write_data(out, "run", {
        "name": os.path.basename(os.path.abspath(path)), "settings": settings,
        "git_commit": run.config.get("git_commit"), "labels": LABELS, "categories": kind.view_categories(env),
        "rounds": rounds, "evals": evals, "ood": ood, "missing": missing, "siblings": siblings,
    })
    for name in ("index.html", "view.js", "view.css"):
        shutil.copyfile(os.path.join(ASSETS, name), os.path.join(out, name))
    with atomic_open(built_path) as f:
        json.dump(built, f)
    return os.path.join(out, "index.html")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="runs/NAME")
    parser.add_argument("--out", help="folder for the viewer (default: RUN/viewer)")
    args = parser.parse_args()
    try:
        page = build(args.run, args.out)
    except RecordError as e:
        sys.exit(f"view: {e}")
    print(page)
