"""A policy folder (a Hugging Face model folder, or a PEFT LoRA adapter folder naming its base): its base, adapter,
config, context, tokenizer, stop ids, sampling defaults, LoRA rank. Nothing here imports torch.
"""

import contextlib
import json
import os

from common.jsonl import RecordError, read_json

# A request's sampling besides its temperature, at plain values: the keys vLLM takes from generation_config
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank takes these


def resolve_model(model_dir):
    """(base folder, adapter folder or None, adapter config or None), both absolute."""
    folder = os.path.abspath(model_dir)
    cfg_path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        if not os.path.isfile(os.path.join(folder, "config.json")):
            # Hub ids are resolved to a local snapshot by loop.sh; stages take folders only.
            raise RecordError(f"{model_dir}: not a model or adapter folder (no config.json)")
        return folder, None, None
    cfg = read_json(cfg_path)
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise RecordError(f"{cfg_path}: no base_model_name_or_path")
    # a relative base against the adapter folder first; peft records it relative to the save's working directory
    beside = os.path.join(folder, base)  # join keeps an absolute base as it is
    base = os.path.abspath(beside if os.path.isfile(os.path.join(beside, "config.json")) else base)
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise RecordError(f"{cfg_path}: base model {base} is not a model folder (no config.json)")
    return base, folder, cfg


def model_context(model_dir):
    """The model's context as bfcl-eval's local inference takes it: max_position_embeddings."""
    base, _, _ = resolve_model(model_dir)
    cfg = read_json(os.path.join(base, "config.json"))
    n = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    if not n:
        raise RecordError(f"{base}/config.json: no max_position_embeddings")
    return int(n)


def model_sampling(model_dir):
    """generation_config.json's PLAIN_SAMPLING defaults, as vLLM's server applies them ({} without one)."""
    base, _, _ = resolve_model(model_dir)
    path = os.path.join(base, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    cfg = read_json(path)
    return {k: cfg[k] for k in PLAIN_SAMPLING if cfg.get(k) is not None}


def load_tokenizer(model_dir):
    """The adapter's tokenizer, else the base's; its own class, not AutoTokenizer (10 s of imports)."""
    base, adapter, _ = resolve_model(model_dir)
    where = adapter if adapter and os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else base
    cls = _own_tokenizer_class(where, base)
    if cls is None:
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(where)


def _own_tokenizer_class(where, base):
    """The tokenizer class `where` names if transformers/models/<model_type>/ defines it, else None."""
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
    eos = None  # read as GenerationConfig.from_pretrained would, without transformers' generation code
    path = os.path.join(base, "generation_config.json")
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    for i in eos if isinstance(eos, list) else [eos]:
        if i is not None and i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError(f"{base}: no eos token id")
    return ids


def lora_rank(cfg):
    """The smallest of vLLM's max_lora_rank values that holds the adapter's largest rank."""
    need = max([cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()])
    for r in VLLM_LORA_RANKS:
        if r >= need:
            return r
    raise ValueError(f"LoRA rank {need} exceeds vLLM's maximum {VLLM_LORA_RANKS[-1]}")
