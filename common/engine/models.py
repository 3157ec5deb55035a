"""A policy folder: its base, adapter, config, context, tokenizer, stop ids, sampling defaults, LoRA rank.

    base, adapter, cfg = resolve_model(model_dir)  # absolute folders; the adapter's config or None
    model_context(model_dir)                       # max_position_embeddings of the base
    tokenizer = load_tokenizer(model_dir)
    stop_ids(tokenizer, base)                      # the ids every engine stops at
    model_sampling(model_dir)                      # generation_config.json's sampling defaults
    lora_rank(cfg)                                 # the --max-lora-rank vLLM serves the adapter with

`model_dir` is a full Hugging Face model folder, or a PEFT LoRA adapter folder (it holds
adapter_config.json, whose base_model_name_or_path names the base folder). Every stage that
loads or serves a policy (common/engine/engines.py, common/engine/serve.py, train_grpo.py, the benches) reads
it through here, so they all load the same base. Nothing here imports torch; transformers only
for the tokenizer.
"""

import json
import os

from common.jsonl import RecordError

# What a request's sampling may set besides its temperature, with the values of plain sampling:
# the keys vLLM's server also takes from a model's generation_config.json (get_diff_sampling_param).
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}

# vLLM's max_lora_rank must be one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def resolve_model(model_dir):
    """(base folder, adapter folder or None, adapter config or None) for a model or adapter folder,
    both absolute."""
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


def model_sampling(model_dir):
    """The sampling defaults in the model's generation_config.json, as vLLM's server applies them
    by default (`--generation-config auto`: the keys of PLAIN_SAMPLING; the request's own
    temperature wins). {} when the model has no generation_config.json."""
    base, _, _ = resolve_model(model_dir)
    path = os.path.join(base, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in PLAIN_SAMPLING if cfg.get(k) is not None}


def load_tokenizer(model_dir):
    """The policy's tokenizer: the adapter folder's own copy if it has one, else the base model's.

    The class AutoTokenizer would pick, without importing AutoTokenizer where the folder names
    its model type's own tokenizer class (Qwen2's Qwen2Tokenizer): transformers' auto module
    imports every model's code (torch, generation, scikit-learn: 10 s of a 13 s start on two
    cores), which a stage that only plays through a server never needs. Anything else (a generic
    or remote-code class, another model type's) goes through AutoTokenizer itself."""
    base, adapter, _ = resolve_model(model_dir)
    where = adapter if adapter and os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else base
    cls = _own_tokenizer_class(where, base)
    if cls is None:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(where)
    return cls.from_pretrained(where)


def _own_tokenizer_class(where, base):
    """The tokenizer class `where` names if it is its model type's own (defined in
    transformers/models/<model_type>/), else None."""
    try:
        with open(os.path.join(where, "tokenizer_config.json"), encoding="utf-8") as f:
            tok_cfg = json.load(f)
        with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return None
    name = tok_cfg.get("tokenizer_class")
    if not isinstance(name, str) or "auto_map" in tok_cfg or not model_type:
        return None
    import transformers
    cls = getattr(transformers, name.removesuffix("Fast"), None)
    own = f"transformers.models.{model_type}.tokenization_{model_type}"
    return cls if cls is not None and cls.__module__ == own else None


def stop_ids(tokenizer, base):
    """The tokenizer's eos plus the eos ids of the base model's generation_config."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # read as GenerationConfig.from_pretrained would, without importing transformers' generation code
    try:
        with open(os.path.join(base, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except OSError:  # no generation_config.json
        eos = None
    for i in eos if isinstance(eos, list) else [eos]:
        if i is not None and i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError(f"{base}: no eos token id")
    return ids


def lora_rank(cfg):
    """The max_lora_rank vLLM serves an adapter config with: the smallest of its ranks that holds
    the adapter's largest (its r, or a layer's rank_pattern)."""
    need = max([cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()])
    for r in VLLM_LORA_RANKS:
        if r >= need:
            return r
    raise ValueError(f"LoRA rank {need} exceeds vLLM's maximum {VLLM_LORA_RANKS[-1]}")
