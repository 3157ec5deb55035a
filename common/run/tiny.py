"""A tiny Qwen2-style tool-calling model, built offline on CPU (the `tiny` preset, tests).

    python -m common.run.tiny [--out DIR] [--steps N] [--seed K] [--env ENV]   # built once into .cache/, reused

A ~4k byte-level BPE (Qwen2's normalizer and pre-tokenizer, as transformers imposes them on a `qwen2` folder;
docs/design.md §7), a random Qwen2 (hidden 128, 2 layers, ~1.5M parameters) whose every layer attends over a
256-token sliding window (so short training examples are what the model meets at any prompt length), and a
short supervised warm start on what ENV's kind gives (its `tiny` hook: the BPE's text, examples cut from its
episodes as rollouts render them). docs/learning-on-cpu.md; bench/tiny_measure.py measures a build.
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import random
import sys
import time

from common.presets import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = PRESETS["tiny"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, not special, as in Qwen3's tokenizer: decoded text keeps them
PAD, EOS = "<|endoftext|>", "<|im_end|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"
# Qwen2's pre-tokenizer split (as imposed by transformers' Qwen2Tokenizer).
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen2.5-Instruct-like chat template (our own text). Assistant messages are rendered
# from their raw `content` (token-in/token-out: the model's own text, tool calls
# included); consecutive `tool` messages form one user block of <tool_response>s.
CHAT_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = messages[0].content -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set system = 'You are a helpful assistant.' -%}
  {%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system -}}
{%- if tools -%}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
  {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in rest -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- elif message.role in ['user', 'assistant', 'system'] -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- else -%}
    {{- raise_exception('unknown message role: ' + message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

NEAR_MISS_SUFFIX = "_old"

# Build arguments (all part of the cache key).
DEFAULTS = {
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "max_positions": 32768,
    "rope_theta": 10_000.0,
    "sliding_window": 256,
    "steps": 180,  # at 90 most of BFCL's groups still failed whole at temperature 1.0
    "batch_size": 16,
    "context": 256,  # tokens before each trained message: the attention window
    "lr": 5e-3,
    "warmup": 6,
    "seed": 0,
    "miss_share": 0.4,  # how often a task is learnt from its near miss: GRPO's groups then mix right and wrong
    "thinking": False,
    "env": "bfcl",  # the environment whose warm start it learns (its kind's `tiny`)
}
# The thinking build (`build_cached(**THINKING)`): a Qwen3ForCausalLM that writes <think>…</think>
# before every message, as Qwen3-8B does; fewer steps, as its tests need the format, not the calls.
THINKING = {"thinking": True, "steps": 60}
MAX_TARGET = 384  # tokens of one assistant message trained on (a few ground-truth turns are longer)


def near_miss(calls):
    """`calls` with "_old" appended to the last string argument of the last call that has one, or None when
    none has. After the whole value, the two answers part at one token, the same in every task, whose split
    the model learns as a shared habit (a prefix made it compete with each task's own value)."""
    calls = [{"name": c["name"], "arguments": dict(c["arguments"])} for c in calls]
    for c in reversed(calls):
        keys = [k for k, v in c["arguments"].items() if isinstance(v, str)]
        if keys:
            c["arguments"][keys[-1]] += NEAR_MISS_SUFFIX
            return calls
    return None


# ----------------------------------------------------------------------------- tokenizer
def train_bpe(texts, vocab_size, added=ADDED_TOKENS):
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer (a `tokenizers.Tokenizer`)."""
    import tokenizers
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS + added,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def hf_tokenizer(bpe, added=ADDED_TOKENS):
    """The transformers Qwen2Tokenizer holding the trained vocabulary, merges and chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, eos_token=EOS, pad_token=PAD,
                         bos_token=None, model_max_length=DEFAULTS["max_positions"])
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_start|>", special=True,
                                                                     normalized=False)]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.chat_template = CHAT_TEMPLATE.strip()
    return tok


# ----------------------------------------------------------------------------- warm-start examples
def make_examples(ids, spans, first_flags, context):
    """(ids, loss positions, is_first_step) per assistant message: `context` tokens before it, then the
    message's first MAX_TARGET tokens; loss position p predicts token p + 1."""
    out = []
    for (s, e), first in zip(spans, first_flags, strict=True):
        start = max(0, s - context)
        e = min(e, s + MAX_TARGET)
        out.append((ids[start:e], [p - start - 1 for p in range(max(s, start + 1), e)], first))
    return out


def token_examples(prompt_ids, ids, mask, context):
    """make_examples' (ids, loss positions, True) tensors of a played episode's tokens (a rollout record's
    "tokens"): one example per run of generated ids (mask 1)."""
    import torch
    spans, start = [], None
    for i, m in enumerate([0] * len(prompt_ids) + list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return [(torch.tensor(x), torch.tensor(pos), first)
            for x, pos, first in make_examples(list(prompt_ids) + list(ids), spans, [True] * len(spans), context)]


class ScriptEngine:
    """The warm start's teacher: an engine (lock-step, one episode) whose every generation is `next_text()`."""

    def __init__(self, tokenizer, next_text):
        self.tokenizer, self.next_text = tokenizer, next_text
        self.stop_ids = [tokenizer.convert_tokens_to_ids(EOS)]

    def generate(self, prompts, max_new_tokens, temperature):
        from common.engine.engines import Generation
        ids = self.tokenizer(self.next_text(), add_special_tokens=False)["input_ids"] + self.stop_ids
        return [Generation(ids=ids, logprobs=[0.0] * len(ids), finish="stop")]


# ----------------------------------------------------------------------------- build
def _log(msg):
    print(f"[tiny] {msg}", file=sys.stderr, flush=True)


def resolved(overrides):
    """(the build's arguments, ENV's warm start): DEFAULTS, `overrides`, and the kind's own steps unless given."""
    from common import envs
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown build argument(s): {', '.join(sorted(unknown))}")
    args = {**DEFAULTS, **overrides}
    warm = envs.tiny(args["env"], args)
    if "steps" not in overrides and warm.steps:
        args["steps"] = warm.steps
    return args, warm


def build(out, **overrides):
    """Build the tiny model folder at `out` (atomically). Returns build_info."""
    from common.jsonl import atomic_dir
    args, warm = resolved(overrides)
    with atomic_dir(out) as tmp:
        return _build_into(tmp, args, warm)


def _build_into(folder, args, warm):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3Config

    from common.jsonl import write_json

    t_start = time.time()
    seed = args["seed"]
    random.seed(seed)
    torch.manual_seed(seed)
    timings = {}
    texts = warm.texts()
    timings["conversations_s"] = round(time.time() - t_start, 2)

    t0 = time.time()
    added = ADDED_TOKENS + (THINK_TOKENS if args["thinking"] else [])
    bpe = train_bpe(texts, args["vocab_size"], added)
    bpe.save(os.path.join(folder, "bpe_tokenizer.json"))  # AutoTokenizer must give its ids (tests/test_tiny.py)
    tok = hf_tokenizer(bpe, added)
    tok.save_pretrained(folder)
    timings["tokenizer_s"] = round(time.time() - t0, 2)

    t0 = time.time()
    examples, weights = warm.examples(tok, bpe)
    weights = [w / sum(weights) for w in weights]
    lens = [len(e[0]) for e in examples]
    timings["examples_s"] = round(time.time() - t0, 2)
    _log(f"{args['env']}: {len(examples)} warm-start examples (mean {sum(lens) / len(lens):.0f} tokens)")

    eos_id, pad_id = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(PAD)
    # the thinking build is Qwen3's architecture (its q/k norms, no qkv bias), the other Qwen2's; the output
    # layer is its own, as Qwen2.5-7B's (a tied model's reload also refreshes it: common/engine/serve.py)
    config = (Qwen3Config if args["thinking"] else Qwen2Config)(
        vocab_size=len(tok), hidden_size=args["hidden_size"], num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"], num_key_value_heads=args["num_kv_heads"],
        intermediate_size=args["intermediate_size"], max_position_embeddings=args["max_positions"],
        rope_parameters={"rope_type": "default", "rope_theta": args["rope_theta"]},
        use_sliding_window=args["sliding_window"] is not None, sliding_window=args["sliding_window"],
        max_window_layers=0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=pad_id, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    t0 = time.time()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    losses = warm_start(model, examples, args, weights)
    timings["train_s"] = round(time.time() - t0, 2)
    model.save_pretrained(folder)
    timings["total_s"] = round(time.time() - t_start, 2)
    info = {"args": args, **warm.info, "n_examples": len(examples), "params": sum(p.numel() for p in model.parameters()),
            "loss_first": losses[0], "loss_last": losses[-1], "timings": timings}
    write_json(os.path.join(folder, "build_info.json"), info)
    _log(f"built in {timings['total_s']:.0f} s ({timings['train_s']:.0f} s training); "
         f"measure it with: python bench/tiny_measure.py")
    return info


def warm_start(model, examples, args, weights):
    """AdamW on the assistant tokens of the examples, drawn with `weights`; the LM head runs
    only at loss positions."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(args["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    steps, warmup = args["steps"], args["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    model.train()
    losses = []
    for step in range(steps):
        batch = rng.choices(range(len(examples)), weights=weights, k=args["batch_size"])
        width = max(len(examples[i][0]) for i in batch)
        ids = torch.full((len(batch), width), model.config.pad_token_id, dtype=torch.long)
        rows, cols, targets, tok_w = [], [], [], []
        for r, i in enumerate(batch):
            x, pos, _ = examples[i]
            ids[r, : len(x)] = x  # right padding: the padded tail is never a loss position
            rows.append(torch.full_like(pos, r))
            cols.append(pos)
            targets.append(x[pos + 1])
            tok_w.append(torch.full((len(pos),), 1.0 / len(pos)))
        rows, cols, targets, tok_w = torch.cat(rows), torch.cat(cols), torch.cat(targets), torch.cat(tok_w)
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden[rows, cols])
        # mean over each example's tokens, then over examples: long multi-call turns do not dominate
        loss = (F.cross_entropy(logits.float(), targets, reduction="none") * tok_w).sum() / len(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        if step % 10 == 0 or step == steps - 1:
            _log(f"step {step}/{steps} loss {loss.item():.3f}")
    model.eval()
    return losses


# ----------------------------------------------------------------------------- cache
def build_key(**overrides):
    """Hash of this file's source and the warm start's module, the build arguments and what ENV's warm start
    learns from (its task files; a τ² domain's tasks, policy, schemas and database, which a user may change)."""
    args, warm = resolved(overrides)
    h = hashlib.sha256()
    for module in (sys.modules[__name__], sys.modules[type(warm).__module__]):
        h.update(inspect.getsource(module).encode())
    h.update(json.dumps(args, sort_keys=True).encode())
    h.update(hashlib.sha256(warm.key()).digest())
    return h.hexdigest()[:16]


def build_cached(cache_root=None, **overrides):
    """Path of the tiny model folder, built once into `<cache_root>/tiny-<hash>/` and reused. SEAL_TINY_SEED=K
    builds (and every caller then uses) another seed's model: tests and the preset checked on other floats."""
    from filelock import FileLock
    overrides.setdefault("seed", int(os.environ.get("SEAL_TINY_SEED", DEFAULTS["seed"])))
    cache_root = cache_root or os.path.join(REPO, ".cache")
    os.makedirs(cache_root, exist_ok=True)
    path = os.path.join(cache_root, f"tiny-{build_key(**overrides)}")
    done = os.path.join(path, "build_info.json")
    if os.path.isfile(done):
        return path
    with FileLock(path + ".lock"):  # another process may be building the same model
        if not os.path.isfile(done):
            _log(f"building {path}")
            build(path, **overrides)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Prints its folder.")
    p.add_argument("--out", help="build into this folder (replaced atomically); default: the cached build "
                   "(.cache/tiny-<hash>, built if missing)")
    p.add_argument("--steps", type=int, default=None, help="warm-start optimiser steps (default: the environment's, "
                   f"else {DEFAULTS['steps']})")
    p.add_argument("--seed", type=int, default=int(os.environ.get("SEAL_TINY_SEED", DEFAULTS["seed"])))
    p.add_argument("--env", default="bfcl", help="the environment whose warm start it learns (a run's ENV)")
    a = p.parse_args(argv)
    args = {"seed": a.seed, "env": a.env, **({"steps": a.steps} if a.steps is not None else {})}
    if a.out:
        build(a.out, **args)
    print(a.out or build_cached(**args))


if __name__ == "__main__":
    main()
