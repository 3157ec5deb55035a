"""Generation engines: token ids in, token ids and per-token log-probabilities out. make_engine("vllm", ...)
plays through running servers (also request by request: submit/poll, request, release), "hf" in this process.
The contract both keep (stops, limits, sampling, log-probs, seeds): docs/hardware.md §3.
"""

import concurrent.futures
import contextlib
import gc
import http.client
import json
import queue
import threading
import urllib.parse
import zlib
from dataclasses import dataclass

from common.engine import serve
from common.engine.models import PLAIN_SAMPLING, load_tokenizer, resolve_model, stop_ids
from common.jsonl import RecordError

SAMPLING_KEYS = ("temperature", *PLAIN_SAMPLING)  # what a request's sampling may set
VLLM_MIN_TEMPERATURE = 0.01


def sampling_params(sampling):
    """{temperature, top_p, ...} for a temperature or a partial dict of SAMPLING_KEYS."""
    if isinstance(sampling, (int, float)):
        sampling = {"temperature": float(sampling)}
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown or "temperature" not in sampling:
        raise ValueError(f"sampling needs a temperature and takes only {SAMPLING_KEYS}: {sampling}")
    out = {**PLAIN_SAMPLING, **sampling}
    if 0 < out["temperature"] < VLLM_MIN_TEMPERATURE:
        # as vLLM's SamplingParams does: bfcl-eval's 0.001 samples at 0.01 on both engines
        out["temperature"] = VLLM_MIN_TEMPERATURE
    return out


@dataclass
class Generation:
    ids: list[int]  # generated ids, including the final eos if produced
    logprobs: list[float]  # one per generated id
    finish: str  # "stop" (eos) or "length"


class Engine:
    """Interface; the contract: docs/hardware.md §3."""

    def __init__(self, model_dir, max_model_len, seed):
        self.base, self.adapter, _ = resolve_model(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = stop_ids(self.tokenizer, self.base)
        self.max_model_len, self.seed, self.calls = max_model_len, seed, 0  # calls: generate() calls, whose seeds differ

    def generate(self, prompts, max_new_tokens, sampling):
        raise NotImplementedError

    def close(self):
        pass

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
        end = next((t + 1 for t, i in enumerate(ids) if i in self.stop_ids), None)
        return Generation(ids[:end], logprobs[:end], "length" if end is None else "stop")


def make_engine(kind, model_dir, *, max_model_len, seed=0, servers=None, **kwargs):
    """An engine for a model or adapter folder: "hf" (in this process) or "vllm" on the servers `servers`."""
    if kind == "hf":
        return HFEngine(model_dir, max_model_len=max_model_len, seed=seed, **kwargs)
    if kind == "vllm":
        if not servers:
            raise ValueError("the vllm engine plays through running servers: pass servers=[URL, ...] "
                             "(common/engine/serve.py starts one)")
        return ServerEngine(servers, model_dir, max_model_len=max_model_len, seed=seed, **kwargs)
    raise ValueError(f"unknown engine kind {kind!r} (vllm or hf)")


# ----------------------------------------------------------------------------- Hugging Face
class HFEngine(Engine):
    """transformers `generate`, left-padded, split so that rows × (prompt + limit) stay in `max_batch_tokens`."""

    def __init__(self, model_dir, *, max_model_len, seed=0, max_batch_tokens=None):
        import torch
        from transformers import AutoModelForCausalLM
        super().__init__(model_dir, max_model_len, seed)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        cpu = self.device.type == "cpu"
        self.max_batch_tokens = max_batch_tokens or (65_536 if cpu else 1_048_576)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32 if cpu else "auto")
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
        batches = [[]]  # longest prompts first: a batch's first row is its widest
        for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
            batch = batches[-1] + [i]
            tokens = len(batch) * (len(prompts[batch[0]]) + max(limits[j] for j in batch))
            if len(batch) > 1 and tokens > self.max_batch_tokens:
                batches.append([i])
            else:
                batches[-1] = batch
        results = [None] * len(prompts)
        # deterministic per (seed, call), without disturbing the caller's global RNG state
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(self.seed * 1_000_003 + self.calls)
            self.calls += 1
            for batch in batches:
                self._run(batch, prompts, limits, sampling, results)
        return results

    def _run(self, batch, prompts, limits, sampling, results):
        import torch
        import transformers
        from tqdm import tqdm
        class Recorder(transformers.LogitsProcessor):
            """Applies the temperature (generate() runs at 1) and keeps the chosen ids' log-probabilities."""

            def __init__(self, temperature):
                self.temperature, self.prev, self.steps = temperature, None, []

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
                return torch.stack(self.steps, dim=1).cpu() if self.steps else torch.zeros((new_ids.shape[0], 0))

        class RowLimit(transformers.StoppingCriteria):
            """Stops each row at its own limit; moves the bar one decoding step."""

            def __call__(self, input_ids, scores, **kwargs):
                new = input_ids.shape[1] - width
                bar.update(1)
                bar.set_postfix(rows=int((~torch.isin(input_ids[:, -1], stops) & (new < row_limits)).sum()),
                                refresh=False)
                return new >= row_limits

        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            mask[r, width - len(prompts[i]):] = 1
        row_limits = torch.tensor([limits[i] for i in batch], device=self.device)
        temperature = sampling["temperature"]
        sample = temperature > 0
        # the request's sampling, never generation_config's; the recorder applies T where vLLM does (before top-k/p)
        warpers = {"temperature": 1.0, "top_k": sampling["top_k"] if sampling["top_k"] > 0 else 0,
                   "top_p": sampling["top_p"], "min_p": sampling["min_p"] or None, "typical_p": 1.0} if sample else {}
        config = transformers.GenerationConfig(
            max_new_tokens=int(row_limits.max()), do_sample=sample, repetition_penalty=sampling["repetition_penalty"],
            no_repeat_ngram_size=0, num_beams=1, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            bos_token_id=None, return_dict_in_generate=True, **warpers)
        recorder = Recorder(temperature if sample else 1.0)
        # the bar counts decoding steps up to the longest row limit; rows that all stop early end short of it
        stops = torch.tensor(sorted({*self.stop_ids, self.pad_id}), device=self.device)
        with torch.no_grad(), tqdm(total=int(row_limits.max()), desc=f"generate {len(batch)} rows", unit="step",
                                   leave=False) as bar:
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config,
                logits_processor=transformers.LogitsProcessorList([recorder]),
                stopping_criteria=transformers.StoppingCriteriaList([RowLimit()]))
        new = out.sequences[:, width:]
        logprobs = recorder.finish(new).tolist()
        for r, i in enumerate(batch):
            results[i] = self._finish(new[r].tolist(), logprobs[r], limits[i])

    def close(self):
        self.model = None
        gc.collect()


# ----------------------------------------------------------------------------- vLLM servers
class ServerEngine(Engine):
    """vLLM servers over HTTP (/v1/completions); each key (a trajectory) stays on one engine until release."""

    def __init__(self, urls, model_dir, *, max_model_len, seed=0, max_in_flight=256, timeout=3600, logs=None,
                 data_parallel_size=None):
        super().__init__(model_dir, max_model_len, seed)
        self.timeout, self.logs = timeout, logs or {}
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
        self.done, self.epoch, self.local = queue.Queue(), 0, threading.local()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="vllm-http")
        self.max_in_flight = max_in_flight
        self.lock = threading.Lock()  # pins, loads, steps and counts, shared with request()'s callers
        self.requesting = set()  # keys with a request() in flight
        self.prompt_tokens = self.cached_tokens = 0

    def _connection(self, url):
        conns = self.local.__dict__.setdefault("conns", {})
        if url not in conns:
            u = urllib.parse.urlparse(url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conns[url] = cls(u.hostname, u.port, timeout=self.timeout)
        return conns[url]

    def _post(self, url, body, rank):
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers[serve.DP_RANK_HEADER] = str(rank)
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
        """(slot, seed) of `key`'s next request: its pinned engine, its seed from (seed, key, step). Locked."""
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
        """One generation for `key`, sent and waited for in the calling thread (thread-safe), as submit()'s."""
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
        """Forget every pending generation (their answers are dropped)."""
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
