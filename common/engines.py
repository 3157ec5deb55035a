"""Generation engines: token ids in, token ids and per-token log-probabilities out.

    engine = make_engine("vllm" | "hf", model_dir, max_model_len=16384, seed=0)
    gens = engine.generate(prompts, max_new_tokens, sampling)      # list[Generation]
    engine.tokenizer                                               # the policy's HF tokenizer
    engine.close()

`model_dir` is a full Hugging Face model folder, or a PEFT LoRA adapter folder (it
holds adapter_config.json, whose base_model_name_or_path names the base folder):
the HF engine loads base + adapter with peft (merged for speed), the vLLM engine
loads the base with enable_lora and passes a LoRARequest with every call.

Common contract of both engines:
- `Generation.ids` are the generated ids, including the final stop id when one was
  produced (`finish == "stop"`); otherwise `finish == "length"`. Generation stops at
  the tokenizer's eos and at the eos ids of the model's generation_config (vLLM does
  the latter by itself; the HF engine is told the same set, `engine.stop_ids`).
- `max_new_tokens[i]` is clamped to `max_model_len - len(prompts[i])`; a prompt
  that leaves no room raises ValueError (the caller decides what a full context means).
- `sampling` is a temperature (plain sampling: no top-k, top-p or penalties, model
  generation_config defaults such as Qwen's top_k=20 overridden) or a dict of
  SAMPLING_KEYS over those plain values: evaluation passes bfcl-eval's temperature
  with `model_sampling(model_dir)`, the defaults its vLLM server takes from the
  model's generation_config.json. `temperature == 0` is greedy decoding.
- `Generation.logprobs[t]` is the log-probability of `ids[t]` under the
  distribution it was drawn from: log_softmax(logits / temperature)[id] when
  sampling, log_softmax(logits)[id] when greedy. At temperature 1 this is the
  model's own log-probability, what a trainer recomputes; at other temperatures it
  is not (a trainer must divide its logits by the same temperature). vLLM gives
  this with logprobs_mode="processed_logprobs", the HF engine with a logits
  logits processor that applies the temperature itself.
- Deterministic for a given seed and sequence of calls: the HF engine reseeds
  torch before every call from (seed, call counter); vLLM uses its engine seed
  (per-request seeds fail on CPU).

The vLLM engine also runs request by request, for per-trajectory scheduling
(common/play.py): `submit(key, prompt, max_new_tokens, sampling)` queues one
generation, `poll()` runs one engine step and returns the `(key, Generation)`
pairs that finished in it, `abort()` drops whatever is still queued. Requests
join the running batch at the next step (continuous batching), so nothing waits
for the longest generation of a step. The engine is the plain `LLM`'s, stepped
synchronously from the caller's thread: no event loop, and with the in-process
engine core (CPU) the same seed and the same calls give the same samples.
`engine.prompt_tokens` / `engine.cached_tokens` count prompt tokens sent and
those served from the prefix cache (vLLM's `num_cached_tokens`), both schedules.
On CPU the in-process engine core runs on one torch thread while the engine is open.
"""

import gc
import json
import os
from dataclasses import dataclass

from common.jsonl import RecordError

# vLLM's max_lora_rank must be one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM on CPU: KV cache size unless VLLM_CPU_KVCACHE_SPACE or kwargs say


# What a request's sampling may set, with the values of plain sampling.
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
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


def model_sampling(model_dir):
    """The sampling defaults in the model's generation_config.json, as vLLM's server applies them
    by default (`--generation-config auto`: the keys of vLLM's get_diff_sampling_param; the
    request's own temperature wins). {} when the model has no generation_config.json."""
    base, _, _ = resolve_model(model_dir)
    path = os.path.join(base, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in PLAIN_SAMPLING if cfg.get(k) is not None}


@dataclass
class Generation:
    ids: list[int]  # generated ids, including the final eos if produced
    logprobs: list[float]  # one per generated id
    finish: str  # "stop" (eos) or "length"


def resolve_model(model_dir):
    """(base folder, adapter folder or None, adapter config or None) for a model or adapter folder,
    both absolute. The one place an adapter's base is found: every stage that loads a policy
    (engines, train_grpo.py, the benches) goes through here, so they all load the same base."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")) and \
            not os.path.isfile(os.path.join(model_dir, "adapter_config.json")):
        # Hub ids are resolved to a local snapshot by loop.sh; stages take folders only.
        raise RecordError(f"{model_dir}: not a model or adapter folder (no config.json)")
    model_dir = os.path.abspath(model_dir)
    cfg_path = os.path.join(model_dir, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        return model_dir, None, None
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise RecordError(f"{cfg_path}: no base_model_name_or_path")
    # A relative base is read against the adapter folder first, so a policy folder loads the
    # same base whatever the working directory; peft itself records the path it was given,
    # relative to the working directory of the save, so that reading is the fallback.
    beside = os.path.join(model_dir, base)  # join keeps an absolute base as it is
    base = os.path.abspath(beside if os.path.isfile(os.path.join(beside, "config.json")) else base)
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise RecordError(f"{cfg_path}: base model {base} is not a model folder (no config.json)")
    return base, model_dir, cfg


def model_context(model_dir):
    """The model's context as bfcl-eval's local inference takes it: max_position_embeddings."""
    base, _, _ = resolve_model(model_dir)
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    n = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    if not n:
        raise RecordError(f"{base}/config.json: no max_position_embeddings")
    return int(n)


def load_tokenizer(model_dir):
    """The policy's tokenizer: the adapter folder's own copy if it has one, else the base model's."""
    from transformers import AutoTokenizer
    base, adapter, _ = resolve_model(model_dir)
    where = adapter if adapter and os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else base
    return AutoTokenizer.from_pretrained(where)


def _stop_ids(tokenizer, base):
    """The tokenizer's eos plus the eos ids of the model's generation_config."""
    from transformers import GenerationConfig
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        eos = GenerationConfig.from_pretrained(base).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    for i in eos if isinstance(eos, list) else [eos]:
        if i is not None and i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError(f"{base}: no eos token id")
    return ids


def _lora_rank(cfg):
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    need = max(ranks)
    for r in VLLM_LORA_RANKS:
        if r >= need:
            return r
    raise ValueError(f"LoRA rank {need} exceeds vLLM's maximum {VLLM_LORA_RANKS[-1]}")


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


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


def make_engine(kind, model_dir, *, max_model_len, seed=0, tensor_parallel_size=1, data_parallel_size=1,
                dtype=None, **kwargs):
    """An engine of `kind` ("vllm" or "hf") for a model or LoRA adapter folder; with
    `data_parallel_size` K > 1, K vLLM replicas of `tensor_parallel_size` GPUs each.

    dtype None means float32 without a GPU and the model's own dtype ("auto") with one.
    Extra keyword arguments go to the engine class (HF: max_batch_tokens; vLLM: LLM kwargs).
    """
    if kind == "hf":
        if tensor_parallel_size != 1 or data_parallel_size != 1:
            raise ValueError("the HF engine runs on one device (tensor and data parallel sizes must be 1)")
        return HFEngine(model_dir, max_model_len=max_model_len, seed=seed, dtype=dtype, **kwargs)
    if kind == "vllm" and data_parallel_size > 1:
        return Replicas(model_dir, data_parallel_size, max_model_len=max_model_len, seed=seed,
                        tensor_parallel_size=tensor_parallel_size, dtype=dtype, **kwargs)
    if kind == "vllm":
        return VLLMEngine(model_dir, max_model_len=max_model_len, seed=seed,
                          tensor_parallel_size=tensor_parallel_size, dtype=dtype, **kwargs)
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
        self.stop_ids = _stop_ids(self.tokenizer, self.base)
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


# ----------------------------------------------------------------------------- vLLM


class VLLMEngine(Engine):
    """vllm.LLM on token prompts; a LoRA adapter is served with a LoRARequest per call."""

    def __init__(self, model_dir, *, max_model_len, seed=0, tensor_parallel_size=1, dtype=None, **llm_kwargs):
        cpu = not _cuda()
        if cpu:
            # In-process engine core: starts in ~3 s instead of 15-18 s on CPU.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM  # slow import: only here

        self.base, self.adapter, cfg = resolve_model(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = _stop_ids(self.tokenizer, self.base)
        self.max_model_len = max_model_len
        kwargs = {"model": self.base, "tokenizer": self.base, "max_model_len": max_model_len, "seed": seed,
                  "tensor_parallel_size": tensor_parallel_size,
                  "dtype": dtype or ("float32" if cpu else "auto"),
                  "logprobs_mode": "processed_logprobs",
                  # On CPU, torch.compile costs ~25 s at start and gains little; GPUs keep graphs.
                  "enforce_eager": cpu}
        if cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # vllm-cpu otherwise reserves 92% of the node's memory and refuses to start on a
            # shared machine; 1 GiB holds ~1M tokens of the tiny model's cache.
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.lora = None
        if self.adapter:
            from vllm.lora.request import LoRARequest
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank(cfg), max_loras=1)
            self.lora = LoRARequest("policy", 1, self.adapter)
        kwargs.update(llm_kwargs)
        self.torch_threads = None
        if cpu and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and "OMP_NUM_THREADS" not in os.environ:
            # The in-process engine core steps in this process's torch, with one OpenMP thread
            # per core (vLLM's own cut to one serving thread is skipped once its CPU worker has
            # patched torch.set_num_threads). On a shared machine every op then waits at a
            # barrier for a descheduled sibling thread: runs measured 2-17x slower under load
            # on 2 cores (docs/benchmarks.md §3). close() gives the process its threads back.
            import torch
            self.torch_threads = torch.get_num_threads()
            torch._C.set_num_threads(1)  # not torch.set_num_threads: vLLM may have patched it
        try:
            self.llm = LLM(**kwargs)
        except BaseException:
            self.close()
            raise
        self.pending = {}  # request id -> (caller's key, limit), for submit/poll
        self.request_counter = 0
        self.prompt_tokens = self.cached_tokens = 0

    def _params(self, limit, sampling):
        from vllm import SamplingParams
        return SamplingParams(**sampling_params(sampling), max_tokens=limit, logprobs=0,
                              stop_token_ids=list(self.stop_ids), detokenize=False)

    def _result(self, out, limit):
        self.prompt_tokens += len(out.prompt_token_ids or [])
        self.cached_tokens += out.num_cached_tokens or 0
        o = out.outputs[0]
        ids = list(o.token_ids)
        lps = [o.logprobs[t][i].logprob for t, i in enumerate(ids)]
        return self._finish(ids, lps, limit)

    def generate(self, prompts, max_new_tokens, sampling):
        from vllm.inputs import TokensPrompt

        limits = self._limits(prompts, max_new_tokens)
        if not prompts:
            return []
        if self.pending:
            raise RuntimeError("generate() while submitted requests are pending")
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 [self._params(m, sampling) for m in limits],
                                 use_tqdm=False, lora_request=self.lora)
        return [self._result(out, limit) for out, limit in zip(outs, limits, strict=True)]

    def submit(self, key, prompt, max_new_tokens, sampling):
        """Queue one generation; its result comes back from poll() under `key`."""
        from vllm.inputs import TokensPrompt

        (limit,) = self._limits([prompt], [max_new_tokens])
        self.request_counter += 1
        rid = f"r{self.request_counter}"
        self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)),
                                        self._params(limit, sampling), lora_request=self.lora)
        self.pending[rid] = (key, limit)

    def poll(self):
        """One engine step; the (key, Generation) pairs of the requests that finished in it."""
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                key, limit = self.pending.pop(out.request_id)
                done.append((key, self._result(out, limit)))
        return done

    def abort(self):
        """Drop every submitted request that has not finished."""
        if self.pending and self.llm is not None:
            self.llm.llm_engine.abort_request(list(self.pending))
        self.pending.clear()

    def close(self):
        if getattr(self, "llm", None) is not None:
            self.abort()
        llm = getattr(self, "llm", None)
        self.llm = None
        if getattr(self, "torch_threads", None):
            import torch
            torch._C.set_num_threads(self.torch_threads)  # the process's other work gets its cores back
            self.torch_threads = None
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )
            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass


class Replicas(Engine):
    """K VLLMEngine replicas behind one submit/poll: each caller key (a trajectory) is pinned
    to one replica from its first request until `release(key)`, so its growing prompt keeps
    hitting that replica's prefix cache; a new key goes to the replica with the fewest keys
    pinned. On GPUs replica r gets the r-th group of `tensor_parallel_size` visible devices
    (its engine core process is started with CUDA_VISIBLE_DEVICES set to that group).
    `poll` steps the replicas in turn: with engine core processes (GPUs, or CPU with
    VLLM_ENABLE_V1_MULTIPROCESSING=1, where each replica's worker gets its own share of
    the cores) it waits for one replica's output while the others keep computing; with
    the in-process engine core (CPU's default here) the replicas run one after another.
    Per-trajectory scheduling only: `generate` (lock-step) is refused.
    """

    def __init__(self, model_dir, k, *, max_model_len, seed=0, tensor_parallel_size=1, **kwargs):
        self.replicas = []
        groups = [None] * k  # per replica: (environment variable, value) that places it
        if _cuda():
            import torch
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]
            if len(visible) < k * tensor_parallel_size:
                raise ValueError(f"{k} replicas x {tensor_parallel_size} GPUs need {k * tensor_parallel_size} "
                                 f"GPUs, {len(visible)} visible")
            groups = [("CUDA_VISIBLE_DEVICES", ",".join(visible[r * tensor_parallel_size:(r + 1) * tensor_parallel_size]))
                      for r in range(k)]
        elif os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in (None, "0") and \
                "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # Engine core processes on CPU: vLLM's automatic thread binding knows of one engine
            # and binds every replica's worker to the same cores, which serialises them
            # (2 replicas on 2 cores: 6.5 s a rollout, 3.6 s with a core each). Split the cores instead.
            cores = sorted(os.sched_getaffinity(0))
            if len(cores) >= k:
                groups = [("VLLM_CPU_OMP_THREADS_BIND",
                           ",".join(map(str, cores[r * len(cores) // k:(r + 1) * len(cores) // k]))) for r in range(k)]
        try:
            for r in range(k):
                self.replicas.append(self._start(groups[r], model_dir, max_model_len=max_model_len, seed=seed + r,
                                                 tensor_parallel_size=tensor_parallel_size, **kwargs))
        except BaseException:
            self.close()
            raise
        first = self.replicas[0]
        self.tokenizer, self.stop_ids, self.max_model_len = first.tokenizer, first.stop_ids, first.max_model_len
        self.pins = {}  # key -> replica index

    @staticmethod
    def _start(group, model_dir, **kwargs):
        """A replica whose engine processes start with `group` = (variable, value) in their environment."""
        if group is None:
            return VLLMEngine(model_dir, **kwargs)
        name, value = group
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return VLLMEngine(model_dir, **kwargs)
        finally:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before

    @property
    def pending(self):
        return {rid: entry for e in self.replicas for rid, entry in e.pending.items()}

    @property
    def prompt_tokens(self):
        return sum(e.prompt_tokens for e in self.replicas)

    @property
    def cached_tokens(self):
        return sum(e.cached_tokens for e in self.replicas)

    def generate(self, prompts, max_new_tokens, sampling):
        raise ValueError("data-parallel replicas run per-trajectory scheduling only (schedule 'async')")

    def submit(self, key, prompt, max_new_tokens, sampling):
        if key not in self.pins:
            load = [0] * len(self.replicas)
            for r in self.pins.values():
                load[r] += 1
            self.pins[key] = load.index(min(load))
        self.replicas[self.pins[key]].submit(key, prompt, max_new_tokens, sampling)

    def release(self, key):
        """The trajectory of `key` is over: its replica may take a new one."""
        self.pins.pop(key, None)

    def poll(self):
        # One step of every replica that has work; on GPUs their engine cores run concurrently.
        return [done for e in self.replicas if e.pending for done in e.poll()]

    def abort(self):
        for e in self.replicas:
            e.abort()
        self.pins.clear()

    def close(self):
        for e in reversed(self.replicas):  # last started first: each restores what it found
            e.close()
        self.replicas = []
