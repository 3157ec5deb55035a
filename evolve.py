"""Evolve the training-time interface: Ω_{t+1} = Evolve(Ω_t, C_t) (docs/design.md §5).

Aggregates the round's --diagnoses into the failure profile C_t, selects the labels under pressure for capability
cues, writes Ω_{t+1} (--out) from Ω_t (--previous) and prints each change; without --diagnoses, the mode's Ω_0.
"""

import argparse
import sys
from collections import defaultdict

from common.jsonl import RecordError, read_jsonl, write_json
from common.presets import MODES
from common.seal import interface
from common.seal.taxonomy import LABELS

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--diagnoses", default=None, help="diagnoses.jsonl of round t (omit to write Ω_0)")
parser.add_argument("--previous", default=None, help="interface.json of round t (default: Ω_0)")
parser.add_argument("--out", required=True, help="interface.json to write (Ω_{t+1})")
parser.add_argument("--mode", default="seal", choices=list(MODES))
parser.add_argument("--min-count", type=int, default=8, help="turns a label needs to get a cue")
parser.add_argument("--min-share", type=float, default=0.10, help="share of all turns a label needs")
parser.add_argument("--max-reward", type=float, default=0.6, help="mean reward must be below this")
parser.add_argument("--max-cues", type=int, default=interface.MAX_CUES, help="capability cues at most")
parser.add_argument("--round", type=int, default=None, help="round of Ω_{t+1} (default: diagnoses' round + 1)")


def read_diagnoses(path):
    records = read_jsonl(path, required=["task_id", "round", "reward", "turn_labels"])
    if not records:
        raise RecordError(f"{path}: no diagnosis records")
    for rec in records:
        where = f"{path}:{rec['_line']}"
        r = rec["reward"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise RecordError(f"{where}: reward must be a number in [0, 1], got {r!r}")
        if not isinstance(rec["round"], int) or isinstance(rec["round"], bool) or rec["round"] < 0:
            raise RecordError(f"{where}: round must be a non-negative integer, got {rec['round']!r}")
        labels = rec["turn_labels"]
        if not isinstance(labels, list) or not labels:
            raise RecordError(f"{where}: turn_labels must be a non-empty list")
        for z in labels:
            if z not in LABELS:
                raise RecordError(f"{where}: unknown label {z!r}")
    return records


def label_stats(records):
    """{label: count, share, mean_reward} over the records' turns; labels in LABELS order."""
    counts, rewards = defaultdict(int), defaultdict(list)
    for rec in records:
        for z in rec["turn_labels"]:
            counts[z] += 1
        for z in set(rec["turn_labels"]):
            rewards[z].append(rec["reward"])
    turns = sum(counts.values())
    return {z: {"count": counts[z], "share": counts[z] / turns,
                "mean_reward": sum(rewards[z]) / len(rewards[z])} for z in LABELS if counts[z]}


def summary(records):
    return {"trajectories": len(records), "turns": sum(len(r["turn_labels"]) for r in records),
            "mean_reward": sum(r["reward"] for r in records) / len(records)}


def failure_profile(records):
    """C_t: label stats over all turns (with the pressure of failure labels) and per category."""
    labels = label_stats(records)
    for z, s in labels.items():
        if z in interface.FAILURE_LABELS:
            s["pressure"] = s["share"] * (1 - s["mean_reward"])
    by_cat = defaultdict(list)
    for rec in records:
        by_cat[rec.get("category", "unknown")].append(rec)
    return {"round": max(r["round"] for r in records), **summary(records), "labels": labels,
            "categories": {c: {**summary(recs), "labels": label_stats(recs)} for c, recs in sorted(by_cat.items())}}


def select(profile, args):
    """(selected labels by pressure, {label: why not selected}) under the thresholds."""
    passing, why_not = [], {}
    for z in interface.FAILURE_LABELS:
        s = profile["labels"].get(z)
        if s is None:
            continue
        if s["count"] < args.min_count:
            why_not[z] = f"count {s['count']} < {args.min_count}"
        elif s["share"] < args.min_share:
            why_not[z] = f"share {s['share']:.3f} < {args.min_share}"
        elif s["mean_reward"] >= args.max_reward:
            why_not[z] = f"mean reward {s['mean_reward']:.3f} >= {args.max_reward}"
        else:
            passing.append(z)
    passing.sort(key=lambda z: -profile["labels"][z]["pressure"])  # stable: ties keep LABELS order
    for z in passing[args.max_cues:]:
        why_not[z] = f"pressure ranks below the top {args.max_cues}"
    return passing[: args.max_cues], why_not


def rounded(obj):
    """Floats rounded so the file is short and stable across platforms."""
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    return obj


def describe(z, profile):
    s = profile["labels"][z]
    pressure = f", pressure {s['pressure']:.3f}" if "pressure" in s else ""
    return f"count {s['count']}, share {s['share']:.3f}, mean reward {s['mean_reward']:.3f}{pressure}"


def main(args):
    cues = MODES[args.mode].omega
    if args.diagnoses is None:  # Ω_0 of the mode
        omega = interface.off() if cues == "off" else interface.initial()
        if args.round is not None:
            omega["round"] = args.round
        write_json(args.out, omega)
        print(f"wrote Ω_0 ({args.mode}) to {args.out}")
        return

    prev = interface.load(args.previous) if args.previous else interface.initial()
    if prev is None:
        raise RecordError(f"{args.previous}: holds no interface (null)")
    records = read_diagnoses(args.diagnoses)
    profile = failure_profile(records)

    print(f"C_t: {profile['trajectories']} trajectories, {profile['turns']} turns, "
          f"mean reward {profile['mean_reward']:.3f}")
    for z in profile["labels"]:
        print(f"  {z:<20} {describe(z, profile)}")

    omega = {"version": prev["version"] + 1,
             "round": args.round if args.round is not None else profile["round"] + 1,
             "schema_cue": dict(prev["schema_cue"]), "error_feedback": prev["error_feedback"],
             "capability_cues": [dict(c) for c in prev["capability_cues"]],
             "profile": rounded(profile), "rho": dict(prev["rho"])}
    changes = []
    if cues == "off":
        omega["schema_cue"], omega["error_feedback"], omega["capability_cues"] = dict(interface.SCHEMA_OFF), False, []
        if prev["schema_cue"]["enabled"]:
            changes.append(f"schema cue off: --mode {args.mode}")
        if prev["error_feedback"]:
            changes.append(f"error feedback off: --mode {args.mode}")
        changes += [f"capability cue off: {c['label']} (--mode {args.mode})" for c in prev["capability_cues"]]
    elif cues == "evolve":  # ("fixed" keeps Ω_t's cues as they are)
        selected, why_not = select(profile, args)
        omega["capability_cues"] = [{"label": z, "text": interface.CAPABILITY_TEXT[z]} for z in selected]
        for z in selected:
            # A family already on stays as it is (its annotations may have been ablated by hand).
            if "schema_cue" in interface.ACTIVATES[z] and not omega["schema_cue"]["enabled"]:
                omega["schema_cue"] = dict(interface.SCHEMA_ON)
                changes.append(f"schema cue on: activated by {z} ({describe(z, profile)})")
            if "error_feedback" in interface.ACTIVATES[z] and not omega["error_feedback"]:
                omega["error_feedback"] = True
                changes.append(f"error feedback on: activated by {z} ({describe(z, profile)})")
        before = [c["label"] for c in prev["capability_cues"]]
        changes += [f"capability cue on: {z} ({describe(z, profile)})" for z in selected if z not in before]
        changes += [f"capability cue off: {z} ({why_not.get(z, 'not seen this round')})"
                    for z in before if z not in selected]

    problem = interface.check(omega)
    assert problem is None, problem
    write_json(args.out, omega)
    print(f"Ω v{prev['version']} -> v{omega['version']} (round {omega['round']}, mode {args.mode}):")
    for line in changes or ["no change"]:
        print(f"  {line}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main(parser.parse_args())
    except RecordError as e:
        sys.exit(f"error: {e}")
