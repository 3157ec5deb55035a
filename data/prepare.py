"""Write the task records of the SEAL split from the installed bfcl-eval.

    python data/prepare.py            # data/train.jsonl, data/heldin.jsonl, data/tiny.jsonl

Reads bfcl-eval's JSON files directly (importing bfcl_eval.utils would create folders in site-packages)
and joins questions, ground truth and tool schemas into one record per task (docs/design.md §3); the
tiny preset's tasks are training tasks cut to their first turn. Skips the work when the files are current.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.jsonl import write_json, write_jsonl  # noqa: E402

BFCL_VERSION = "2026.3.23"
CATEGORIES = ["base", "miss_func", "miss_param", "long_context"]
HERE = os.path.dirname(os.path.abspath(__file__))
# the tiny preset: per category, the first training tasks whose first turn needs at most TINY_MAX_CALLS
# calls (a 1 M CPU model can learn to write those), cut to their first TINY_TURNS turn(s)
TINY_PER_CATEGORY, TINY_MAX_CALLS, TINY_TURNS = 2, 2, 1
CLASS_DOC_FILES = {"GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
                   "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json", "TicketAPI": "ticket_api.json",
                   "TradingBot": "trading_bot.json", "TravelAPI": "travel_booking.json",
                   "VehicleControlAPI": "vehicle_control.json"}


def bfcl_data_dir():
    try:
        version = importlib.metadata.version("bfcl-eval")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("error: bfcl-eval is not installed; run `bash setup.sh`")
    if version != BFCL_VERSION:
        sys.exit(f"error: bfcl-eval {version} is installed, this project is pinned to {BFCL_VERSION}")
    spec = importlib.util.find_spec("bfcl_eval")
    return os.path.join(spec.submodule_search_locations[0], "data")


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_tasks(data_dir):
    docs = {cls: read_lines(os.path.join(data_dir, "multi_turn_func_doc", name))
            for cls, name in CLASS_DOC_FILES.items()}
    tasks = {}
    for cat in CATEGORIES:
        name = f"BFCL_v4_multi_turn_{cat}.json"
        answers = {a["id"]: a["ground_truth"] for a in read_lines(os.path.join(data_dir, "possible_answer", name))}
        for entry in read_lines(os.path.join(data_dir, name)):
            # bfcl-eval's populate_test_cases_with_predefined_functions: the involved classes' functions,
            # minus the held-out ones until their turn, in the entry's order (as bfcl-eval announces them)
            tools = [doc for cls in entry["involved_classes"] for doc in docs[cls]]
            missed = {}
            for turn, names in entry.get("missed_function", {}).items():
                missed[turn] = [next(t for t in tools if t["name"] == name) for name in names]
                tools = [t for t in tools if t["name"] not in names]
            tasks[entry["id"]] = {"id": entry["id"], "category": cat, "questions": entry["question"],
                                  "initial_config": entry["initial_config"], "involved_classes": entry["involved_classes"],
                                  "tools": tools, "missed_function": missed, "long_context": cat == "long_context",
                                  "ground_truth": answers[entry["id"]]}
    return tasks


def first_turns(task, k):
    """`task` cut to its first `k` turns, a task of its own (id suffixed `_<k>turn`)."""
    return {**task, "id": f"{task['id']}_{k}turn", "questions": task["questions"][:k],
            "ground_truth": task["ground_truth"][:k],
            "missed_function": {t: v for t, v in task["missed_function"].items() if int(t) < k}}


def tiny_tasks(train):
    """The tiny preset's tasks from training tasks (file order), each scenario number once across categories."""
    out, taken = [], set()
    for cat in CATEGORIES:
        fit = [t for t in train if t["category"] == cat and len(t["ground_truth"][0]) <= TINY_MAX_CALLS
               and t["id"].rsplit("_", 1)[1] not in taken]
        for t in fit[:TINY_PER_CATEGORY]:
            taken.add(t["id"].rsplit("_", 1)[1])
            out.append(first_turns(t, TINY_TURNS))
    return out


def main():
    split_path = os.path.join(HERE, "split.json")
    with open(split_path, "rb") as f:
        split_bytes = f.read()
    split = json.loads(split_bytes)
    stamp_path = os.path.join(HERE, ".prepared.json")
    stamp = {"bfcl_eval": BFCL_VERSION, "split_sha256": hashlib.sha256(split_bytes).hexdigest(),
             "prepare_sha256": hashlib.sha256(open(__file__, "rb").read()).hexdigest()}
    outputs = [os.path.join(HERE, f"{name}.jsonl") for name in ("train", "heldin", "tiny")]
    data_dir = bfcl_data_dir()
    if all(os.path.isfile(p) for p in outputs) and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                print("prepare: data/train.jsonl, data/heldin.jsonl and data/tiny.jsonl are current")
                return

    tasks = build_tasks(data_dir)
    if set(split["train"]) & set(split["heldin"]):
        sys.exit(f"error: {split_path}: train and heldin share task ids")
    for name, out in zip(("train", "heldin", "tiny"), outputs, strict=True):
        if name == "tiny":
            records = tiny_tasks([tasks[i] for i in split["train"]])
        else:
            missing = [i for i in split[name] if i not in tasks]
            if missing:
                sys.exit(f"error: {split_path}: {len(missing)} {name} id(s) not in bfcl-eval {BFCL_VERSION}, "
                         f"e.g. {missing[0]}")
            records = [tasks[i] for i in split[name]]
        counts = {c: sum(r["category"] == c for r in records) for c in CATEGORIES}
        write_jsonl(out, records)
        print(f"prepare: {os.path.relpath(out)}: {len(records)} tasks {counts}")
    write_json(stamp_path, stamp)


if __name__ == "__main__":
    main()
