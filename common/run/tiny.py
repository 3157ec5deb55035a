"""A tiny Qwen2-style tool-calling model, built offline on CPU (the `tiny` preset, tests).

    python -m common.run.tiny                    # build once into .cache/ (or reuse), print the folder
    python -m common.run.tiny --out DIR [--steps N] [--seed K] [--env tau2:DOMAIN]
    python bench/tiny_measure.py             # measure the build (minutes; the tests do not need it)

Builds a normal Hugging Face model folder in three steps (under a minute of 2 idle cores):

1. Tokenizer: a ~4k byte-level BPE trained with the `tokenizers` library on text of
   the task file (questions, tool documentation, rendered ground-truth turns). It uses
   exactly the normalizer (NFC) and pre-tokenizer (Qwen2's split regex + ByteLevel)
   that transformers 5.x imposes on any folder whose config says `qwen2` (docs/design.md §7),
   so AutoTokenizer gives the same ids as the trained tokenizer (kept as
   `bpe_tokenizer.json` for that check). Special tokens `<|endoftext|>` (pad),
   `<|im_start|>`, `<|im_end|>` (eos); added tokens `<tool_call>`, `</tool_call>`,
   `<tool_response>`, `</tool_response>`. The chat template (CHAT_TEMPLATE) behaves
   like Qwen2.5-Instruct's.
2. Model: a randomly initialised Qwen2 (hidden 128, 2 layers, 4 heads, 2 KV heads,
   untied embeddings, ~1.5M parameters, 32k positions) whose layers all use Qwen2's
   sliding-window attention over the last `sliding_window` (256) tokens, with
   rope_theta 1e4 (plenty of resolution for distances under 256). The output layer
   is its own, as Qwen2.5-7B's is, so the tiny loop runs the engine path the 7B preset
   runs (a tied model's reload also refreshes its output layer: common/engine/serve.py).

   Why a sliding window: BFCL prompts are ~5k tokens with this BPE (up to ~11k plus
   the conversation), far beyond what a CPU warm start can train on. A full-attention
   model trained on short windows breaks on long prompts (measured: a model that
   answered 8/8 first steps correctly with the last 160 prompt tokens answered 2/8
   with 512 and 0/8 with 2048: attention spreads over thousands of unseen tokens).
   With the window, every position sees at most 256 tokens at any prompt length, so
   the short training examples are exactly what the model meets at inference, all
   32k positions work, and the KV cache stays small. transformers and vLLM both
   implement Qwen2's window (vLLM's CPU attention too); their log-probabilities agree.
3. Warm start: a short supervised fine-tune (AdamW, fp32) on conversations of the preset's
   tasks with real tool results from common.envs.bfcl.harness.Environment (see `conversation`), rendered
   as rollouts show them: bfcl-eval's QwenFCHandler prompts, token-in/token-out (`render`,
   common/envs/bfcl/prompts.py). Each call task is taught its ground truth and, `miss_share` (40 %) of
   the time, a near miss (`near_miss`: one file or folder name suffixed "_old", which the
   official checker fails), so the model's samples split between a right and a wrong answer
   and GRPO's groups are mixed (7 of the 8 tasks, all but the abstention, at temperature 1.0
   and 0.7: docs/learning-on-cpu.md §1a). 180 steps: at 90 the rest of the calls was still
   sampled wrong too often at 1.0, so most groups failed whole. Loss only on assistant
   tokens (their content and the closing `<|im_end|>`), averaged per message, then
   over the batch (so the few 30-call turns do not teach "one more call" to all).

   Window choice: one training example per assistant message: the `context` (256)
   tokens before it (= the attention window) and the message itself (at most
   MAX_TARGET tokens). For the first step of turn 0 that is the end of the tool list,
   the user message and the generation prompt. The language-model head is applied
   only at the loss positions (it is half the model's compute). Without a preset (the
   whole task file), messages answering a user message (tool calls, or "something is
   missing" on empty-ground-truth turns) are sampled 4x as often as the closing answers
   after tool results.

The thinking build (`build_cached(**THINKING)`, tests/test_thinking.py) is the same builder with
`thinking`: a Qwen3ForCausalLM (vLLM serves it on CPU too) whose tokenizer adds `<think>` and
`</think>` as Qwen3's does, and whose every assistant message opens with a short reasoning,
`<think>\n…\n</think>\n\n`, as QwenFCHandler re-wraps it; 60 steps, as its tests need the format,
not the calls. Its warm start renders the conversations token-in/token-out with the reasoning kept
(each example reads only the 256 tokens before its message).

The τ² build (`build_cached(env="tau2:DOMAIN")`, `python -m common.run.tiny --env tau2:DOMAIN`; loop.sh builds
it for `tiny --set ENV=tau2:DOMAIN`) is the same model trained on another warm start: the oracle's episodes
of the domain's first TINY_TAU2_TASKS (8) train tasks against the scripted ScenarioUser, rendered by the
rollouts' own policy, with near misses on the writes (`tau2_examples`); its BPE is trained on the domain's
policy, tool schemas and those episodes, and it trains TAU2_STEPS (300) steps.

The chat template is kept for `--prompts template`. What a build samples is measured apart, by
bench/tiny_measure.py, so that this file is the build alone: `build_cached()` builds once into
`<repo>/.cache/tiny-<hash>/` (hash of this file, the arguments and the task files) and reuses it.
"""

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time

from common.presets import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TASKS = os.path.join(REPO, "data", "train.jsonl")
TINY = PRESETS["tiny"]
PRESET_TASKS = os.path.join(REPO, TINY.tasks)  # the tiny preset's tasks (data/prepare.py)

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

DONE_ANSWER = "Done: the requested operations have been carried out."
NEAR_MISS_SUFFIX = "_old"
MISSING_ANSWER = {
    "miss_func": "I cannot do this with the functions I have: the function it needs is missing.",
    "miss_param": "I cannot do this yet: some required information is missing. Please provide it.",
}
DEFAULT_MISSING = "I cannot do this: something required is missing."

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
    "steps": 180,
    "batch_size": 16,
    "context": 256,
    "lr": 5e-3,
    "answer_weight": 0.25,
    "warmup": 6,
    "seed": 0,
    "miss_share": 0.4,
    "thinking": False,
    "env": "bfcl",  # or tau2:DOMAIN: the warm start plays that domain's tiny training tasks (`tau2_examples`)
}
# The thinking build (`build_cached(**THINKING)`): a Qwen3ForCausalLM that writes <think>…</think>
# before every message, as Qwen3-8B does; fewer steps, as its tests need the format, not the calls.
THINKING = {"thinking": True, "steps": 60}
# A τ² build (`build_cached(env="tau2:DOMAIN")`) trains longer: its episodes are several calls long, and
# airline's five-call task was solved in 0 of 16 samples at temperature 1.0 after 180 steps, 5 of 16 after 300.
TAU2_STEPS = 300
MAX_TARGET = 384  # tokens of one assistant message trained on (a few ground-truth turns are longer)


# ----------------------------------------------------------------------------- tools and text


def near_miss(calls):
    """`calls` with "_old" appended to the last string argument of the last call that has one (a
    file or folder that is not the asked one), or None when no call has a string argument.

    The suffix comes after the whole right value: the two answers part at one token, the same
    in every task, whose split the model learns as a shared habit. (A prefix, "new_", made the
    shared token compete with each task's own value, which the model recalls less surely:
    it then wrote the near miss on most tasks, greedy and sampled.)"""
    calls = [{"name": c["name"], "arguments": dict(c["arguments"])} for c in calls]
    for c in reversed(calls):
        keys = [k for k, v in c["arguments"].items() if isinstance(v, str)]
        if keys:
            c["arguments"][keys[-1]] += NEAR_MISS_SUFFIX
            return calls
    return None


def conversation(task, miss=False, thinking=False):
    """The ground-truth conversation of `task` as chat messages, with real tool results.

    Per turn: the user message(s); if the turn's ground truth is not empty, one
    assistant message holding all its calls as Qwen <tool_call> blocks, the tool
    messages with what the environment returned, and a short closing answer;
    otherwise a short answer saying what is missing. With `miss`, every turn's calls are
    their `near_miss` (executed, so the results are real too); None when the task has no calls
    or a turn's calls have no near miss. With `thinking`, every assistant message opens with a
    short reasoning in Qwen3's form (`think`).
    """
    from common.engine import calls as C
    from common.envs.bfcl import harness as bfcl

    messages, missed = [], False
    with bfcl.Environment(task) as env:
        for turn in range(len(task["questions"])):
            env.start_turn(turn)
            messages.extend({"role": m["role"], "content": m["content"]} for m in bfcl.turn_messages(task, turn))
            gt = bfcl.ground_truth_calls(task, turn)
            if not gt:
                messages.append({"role": "assistant", "content": think("Something I need is missing.", thinking)
                                 + MISSING_ANSWER.get(task["category"], DEFAULT_MISSING)})
                continue
            if miss:
                gt = near_miss(gt)
                if gt is None:
                    return None
                missed = True
            results, _ = env.run_calls(gt)
            names = ", ".join(c["name"] for c in gt)
            messages.append({"role": "assistant", "content": think(f"I will call {names}.", thinking)
                             + C.format_calls(gt, "json")})
            messages.extend({"role": "tool", "content": r} for r in results)
            messages.append({"role": "assistant", "content": think("The calls ran.", thinking) + DONE_ANSWER})
    return messages if missed or not miss else None


def think(reasoning, thinking):
    """The reasoning a thinking model writes before its message, as QwenFCHandler re-wraps it."""
    return f"<think>\n{reasoning}\n</think>\n\n" if thinking else ""


def pick_eval_tasks(tasks, n):
    """`n` tasks whose turn 0 has ground-truth calls, taken round-robin over categories in file order.

    (Turn 0 of many miss_func/miss_param tasks has no ground truth: the right first
    output there is a plain answer, not a call.)
    """
    by_cat = {}
    for t in tasks:
        if t["ground_truth"][0]:
            by_cat.setdefault(t["category"], []).append(t)
    picked, i = [], 0
    while len(picked) < n and any(i < len(v) for v in by_cat.values()):
        picked.extend(v[i] for v in by_cat.values() if i < len(v))
        i += 1
    return picked[:n]


def render(task, msgs, omega=None):
    """A conversation from `conversation` as a rollout's context spells it: bfcl-eval's
    QwenFCHandler prompt (tools and cues as the interface `omega` shows them), each assistant message as
    written followed by what the handler adds after it (common/envs/bfcl/prompts.py, token-in/token-out)."""
    from common.envs.bfcl.prompts import Conversation, announced
    from common.seal.interface import system_cue, tool_view

    def announce(turn):
        docs = announced(task, turn)
        return tool_view(docs, omega) if docs is not None else None

    conv = Conversation("QwenFCHandler", task, tool_view(task["tools"], omega), system_cue(omega))
    i, turn = 0, 0
    while i < len(msgs) and msgs[i]["role"] == "user":
        i += 1
    conv.add_user(0, conv.turn_messages(0, announce(0)))
    text = conv.prompt()
    while i < len(msgs):
        content = msgs[i]["content"]
        i += 1
        results = []
        while i < len(msgs) and msgs[i]["role"] == "tool":
            results.append(msgs[i]["content"])
            i += 1
        nxt = None
        if i < len(msgs) and msgs[i]["role"] == "user":
            while i < len(msgs) and msgs[i]["role"] == "user":
                i += 1
            turn += 1
            nxt = conv.turn_messages(turn, announce(turn))
        text += content + conv.continuation(results or None, [""] * len(results), nxt)
    return text.removesuffix(GENERATION_PROMPT)


# ----------------------------------------------------------------------------- tokenizer


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_bpe(texts, vocab_size, added=ADDED_TOKENS):
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer (a `tokenizers.Tokenizer`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
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


def tokenizer_texts(tasks, conversations):
    """Training text for the BPE: tool docs, questions and rendered ground-truth turns, deduplicated."""
    seen, texts = set(), []

    def add(s):
        if s and s not in seen:
            seen.add(s)
            texts.append(s)

    from common.envs.bfcl import prompts

    for task in tasks:
        # the tool docs and held-out-tool messages as bfcl-eval's QwenFCHandler shows them
        for tool in prompts.hinted(task["id"], task["tools"]) + [s for v in task["missed_function"].values() for s in v]:
            add(json.dumps(tool))
        for docs in task["missed_function"].values():
            add(prompts.new_tools_message(docs)[0]["content"])
        for msgs in task["questions"]:
            for m in msgs:
                add(m["content"])
    for msgs in conversations:
        for m in msgs:
            add(m["content"][:20_000])
    add(CHAT_TEMPLATE)
    return texts


# ----------------------------------------------------------------------------- warm-start data


def assistant_spans(text):
    """Character spans [start, end) of assistant contents plus their closing <|im_end|>."""
    head = "<|im_start|>assistant\n"
    spans, pos = [], 0
    while True:
        i = text.find(head, pos)
        if i < 0:
            return spans
        start = i + len(head)
        end = text.index(EOS, start) + len(EOS)
        spans.append((start, end))
        pos = end


def token_spans(enc, char_spans):
    """Token index spans matching character spans; tokens must not straddle a boundary."""
    offsets = enc.offsets
    starts = {s: i for i, (s, _) in enumerate(offsets)}
    ends = {e: i + 1 for i, (_, e) in enumerate(offsets)}
    out = []
    for cs, ce in char_spans:
        if cs not in starts or ce not in ends:
            raise RuntimeError(f"assistant span {cs}:{ce} does not fall on token boundaries")
        out.append((starts[cs], ends[ce]))
    return out


def warm_start_examples(tok, bpe, tasks, convs, context, omega=None):
    """Training examples (ids, loss positions, is_first_step) of all conversations, with the
    tool list as the interface `omega` shows it (common.seal.interface.tool_view; None: plain).

    A rendered conversation is the system block (the tool list, ~4-7k tokens) and
    the messages after it, which start with the special token <|im_start|>, so the
    two tokenise independently. Only the end of the system block is ever used: it is
    tokenised once per distinct tool list.
    """
    import torch

    sys_cache, sys_ids, conv_texts = {}, [], []
    for task, msgs in zip(tasks, convs, strict=True):
        text = render(task, msgs, omega)
        cut = text.index(EOS + "\n") + len(EOS) + 1
        if text[cut:].find("<|im_start|>") != 0:
            raise RuntimeError("the chat template's system block is not followed by <|im_start|>")
        if text[:cut] not in sys_cache:
            sys_cache[text[:cut]] = bpe.encode(text[:cut]).ids[-context:]
        sys_ids.append(sys_cache[text[:cut]])
        conv_texts.append(text[cut:])
    examples = []
    for head, text, enc, msgs in zip(sys_ids, conv_texts, bpe.encode_batch(conv_texts), convs, strict=True):
        spans = [(s + len(head), e + len(head)) for s, e in token_spans(enc, assistant_spans(text))]
        # an assistant message that answers a user message is the first step of its turn
        first_flags = [prev["role"] == "user" for prev, m in zip(msgs, msgs[1:], strict=False)
                       if m["role"] == "assistant"]
        for x, pos, first in make_examples(head + enc.ids, spans, first_flags, context):
            examples.append((torch.tensor(x), torch.tensor(pos), first))
    return examples


def make_examples(ids, spans, first_flags, context):
    """One example per assistant message: `context` tokens before it, then the message.

    Returns (ids, loss positions, is_first_step) triples; loss position p predicts token p + 1.
    A message longer than MAX_TARGET tokens keeps only its first MAX_TARGET tokens.
    """
    out = []
    for (s, e), first in zip(spans, first_flags, strict=True):
        start = max(0, s - context)
        e = min(e, s + MAX_TARGET)
        out.append((ids[start:e], [p - start - 1 for p in range(max(s, start + 1), e)], first))
    return out


# ----------------------------------------------------------------------------- τ² warm start
# A τ² build (`env="tau2:DOMAIN"`, what loop.sh builds for `tiny --set ENV=tau2:DOMAIN`) learns the
# episodes its loop plays: the first TINY_TAU2_TASKS tasks of the domain's train split, against the
# scripted ScenarioUser, each agent message the oracle's (common/envs/tau2/tau2.py OracleScript), rendered by the
# rollouts' own token-in/token-out policy (ModelPolicy). As on BFCL, each task whose gold actions
# write something is also learnt with a near miss: its last write's last string argument suffixed
# "_old" (τ²'s tool refuses it, the database is not changed, τ²'s evaluator gives 0), so sampled
# episodes split between the two and GRPO's groups are mixed; a reading task that must tell the user
# something has a closing message without it as its near miss. Other reading tasks have none: any
# agent that changes nothing solves them.


class ScriptEngine:
    """The warm start's teacher: an engine whose every generation is the script's next agent message."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.stop_ids = [tokenizer.convert_tokens_to_ids(EOS)]

    def generate(self, prompts, max_new_tokens, temperature):
        from common.engine.engines import Generation
        ids = self.tokenizer(self.script.agent_text(None, None), add_special_tokens=False)["input_ids"]
        ids += self.stop_ids
        return [Generation(ids=ids, logprobs=[0.0] * len(ids), finish="stop")]


def tau2_scripts(env_name, with_misses):
    """[(τ² task, make_script)] for the tiny τ² tasks: `make_script(miss)` is a fresh OracleScript,
    or with `miss` its near miss (None where the task writes nothing with a string argument)."""
    from common import envs
    from common.envs.tau2 import tau2
    from common.jsonl import RecordError
    from common.presets import TINY_TAU2_TASKS

    env = envs.load(f"{env_name}:train", user="scripted")
    toolkit = env.tau2.registry.get_env_constructor(env.domain)().tools
    if not env.tasks:
        raise RecordError(f"{env_name}:train has no task a scripted episode can start")
    out = []
    for task in [t["tau2"] for t in env.tasks.values()][:TINY_TAU2_TASKS]:
        def make(miss, task=task):
            script = tau2.OracleScript(task, "json", shared=False)
            if not miss:
                return script
            writes = [i for i, a in enumerate(script.actions) if a.requestor == "assistant"
                      and toolkit.has_tool(a.name) and toolkit.tool_type(a.name).value == "write"
                      and any(isinstance(v, str) for v in a.arguments.values())]
            if not with_misses or not (writes or script.info):
                return None
            if not writes:  # a reading task scored on what it tells the user: the closing message omits it
                script.info = []
                return script
            a = script.actions[writes[-1]]
            call = near_miss([{"name": a.name, "arguments": a.arguments}])[0]
            script.actions[writes[-1]] = a.model_copy(update={"arguments": call["arguments"]})
            return script
        out.append((env, task, make))
    return out


def tau2_play(env, task, script, engine=None, omega=None, evaluate=True):
    """One scripted episode against the ScenarioUser: τ²'s result row (with `evaluate`, its reward)
    and the agent's policy (the script's text function, or with `engine` the rollouts' ModelPolicy
    writing through it)."""
    from common.envs.bfcl.play import PlaySpec
    from common.envs.tau2 import tau2

    made = []

    def players(task, tools, user_tools, system, fmt):
        policy = tau2.ModelPolicy(engine, tools, system, PlaySpec(omega=omega)) if engine else script.agent_text
        made.append(policy)
        return policy, env.tau2.classes[4](task)
    row = env.tau2.play(env.domain, task, players, env.max_steps, "json", evaluate=evaluate)
    return row, made[0]


def tau2_fingerprint(env_name):
    """What a τ² build learns from: its tasks, the domain's policy, tool schemas and database hash."""
    from common import envs
    from common.presets import TINY_TAU2_TASKS

    env = envs.load(f"{env_name}:train", user="scripted")
    domain = env.tau2.registry.get_env_constructor(env.domain)()
    tasks = [t["tau2"].model_dump(mode="json") for t in env.tasks.values()][:TINY_TAU2_TASKS]
    return json.dumps([tasks, domain.get_policy(), env.tau2.schemas(env.domain), domain.get_db_hash()],
                      sort_keys=True, default=str).encode()


def tau2_texts(scripts):
    """The BPE's training text: the domain's policy and tool schemas, the scripted episodes' messages.
    Each episode is played once here and τ²'s reward of it logged (right 1, near misses 0)."""
    env = scripts[0][0]
    texts = [CHAT_TEMPLATE, env.tau2.registry.get_env_constructor(env.domain)().get_policy(),
             *(json.dumps(s) for s in env.tau2.schemas(env.domain))]
    rewards = {False: [], True: []}
    for env, task, make in scripts:
        for miss in (False, True):
            script = make(miss)
            if script is None:
                continue
            row, _ = tau2_play(env, task, script)
            rewards[miss].append(row["reward"])
            for m in row["transcript"]:
                texts.append(m.get("content") or "")
                texts += [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in m.get("tool_calls") or []]
    _log(f"{env.source}: τ²'s reward of the scripted episodes: {sum(rewards[False]):.0f}/{len(rewards[False])} "
         f"right, {sum(rewards[True]):.0f}/{len(rewards[True])} near misses")
    return [t for t in texts if t]


def tau2_examples(scripts, tok, context, share):
    """(examples, weights): every agent message of the scripted episodes, in both views of the tools
    (plain, and with Ω_0's schema cue), as `make_examples` cuts them from the rollout's own tokens."""
    import torch

    from common.seal import interface as omega_api

    examples, weights = [], []
    for omega in (None, omega_api.initial()):
        for env, task, make in scripts:
            miss = make(True)
            for script, w in ((make(False), 1.0 - share if miss else 1.0), (miss, share)):
                if script is None or w <= 0:
                    continue
                _, policy = tau2_play(env, task, script, ScriptEngine(tok, script), omega, evaluate=False)
                ids = policy.prompt_ids + policy.ids
                spans, start = [], None
                for i, m in enumerate([0] * len(policy.prompt_ids) + policy.mask + [0]):
                    if m and start is None:
                        start = i
                    elif not m and start is not None:
                        spans.append((start, i))
                        start = None
                for x, pos, first in make_examples(ids, spans, [True] * len(spans), context):
                    examples.append((torch.tensor(x), torch.tensor(pos), first))
                    weights.append(w)
    return examples, weights


# ----------------------------------------------------------------------------- build


def _log(msg):
    print(f"[tiny] {msg}", file=sys.stderr, flush=True)


def build(out, *, tasks_path=DEFAULT_TASKS, preset_path=PRESET_TASKS, on_step=None, **overrides):
    """Build the tiny model folder at `out` (atomically). Returns build_info."""
    from common.jsonl import atomic_dir
    args = {**DEFAULTS, **overrides}
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown build argument(s): {', '.join(sorted(unknown))}")
    with atomic_dir(out) as tmp:
        info = _build_into(tmp, tasks_path, preset_path, args, on_step)
    return info


def _build_into(folder, tasks_path, preset_path, args, on_step=None):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3Config

    from common.envs.bfcl import harness as bfcl
    from common.jsonl import write_json
    from common.seal import interface as omega_api

    t_start = time.time()
    seed = args["seed"]
    random.seed(seed)
    torch.manual_seed(seed)
    timings = {}

    # --- data: ground-truth conversations with real tool results (a τ² build: oracle episodes)
    thinking, tau2_env = args["thinking"], args["env"] if args["env"] != "bfcl" else None
    if tau2_env:
        tasks, convs = [], []
        scripts = tau2_scripts(tau2_env, args["miss_share"] > 0)
        texts = tau2_texts(scripts)
    else:
        tasks = list(bfcl.load_tasks(tasks_path).values())
        convs = [conversation(t, thinking=thinking) for t in tasks]
        texts = tokenizer_texts(tasks, convs)
    timings["conversations_s"] = round(time.time() - t_start, 2)

    # --- tokenizer
    t0 = time.time()
    added = ADDED_TOKENS + (THINK_TOKENS if thinking else [])
    bpe = train_bpe(texts, args["vocab_size"], added)
    bpe.save(os.path.join(folder, "bpe_tokenizer.json"))
    tok = hf_tokenizer(bpe, added)
    tok.save_pretrained(folder)
    timings["tokenizer_s"] = round(time.time() - t0, 2)

    # --- tokenise the conversations and cut training examples
    # With the preset's tasks (training tasks cut to their first turn), they are all the warm start
    # learns: a 1 M model trained for minutes on the whole split writes the format but not the
    # calls (measured: 0 of 7 call tasks solved at 300 steps, also with the preset's examples drawn
    # 40x as often); on 8 tasks it learns them within ~100 steps. Both views of their tool list:
    # plain (vanilla) and with the schema cue (SEAL's Ω_0), whose annotations fill the 256-token
    # window before the question.
    # Each call task is learnt twice: its ground truth, and, `miss_share` of the time, a near miss
    # (the same calls, one name suffixed "_old": the official checker says 0). The two differ in
    # one token, whose split the model learns, so GRPO groups are mixed where the rest of the calls
    # is sampled right (after 180 steps nearly always, at temperature 1.0 too); a model taught the ground
    # truth alone is nearly deterministic on it, solved always or never (docs/learning-on-cpu.md §1a).
    t0 = time.time()
    preset = list(bfcl.load_tasks(preset_path).values()) if preset_path and not tau2_env else []
    examples, weights = [], []
    if tau2_env:
        examples, weights = tau2_examples(scripts, tok, args["context"], args["miss_share"])
    elif preset:
        pairs = [(t, conversation(t, thinking=thinking), conversation(t, miss=True, thinking=thinking))
                 for t in preset]
        share = args["miss_share"]
        for omega in (None, omega_api.initial()):
            for task, right, miss in pairs:
                for msgs, w in ((right, 1.0 - share if miss else 1.0), (miss, share)):
                    if msgs is not None and w > 0:
                        ex = warm_start_examples(tok, bpe, [task], [msgs], args["context"], omega)
                        examples += ex
                        weights += [w] * len(ex)
    else:  # no preset: the whole split, whose answers to tool results ("Done: ...") are easy: drawn less often
        examples = warm_start_examples(tok, bpe, tasks, convs, args["context"])
        weights = [1.0 if first else args["answer_weight"] for _, _, first in examples]
    weights = [w / sum(weights) for w in weights]
    lens = [len(e[0]) for e in examples]
    timings["examples_s"] = round(time.time() - t0, 2)
    _log(f"{len(scripts) if tau2_env else len(tasks)} tasks, {len(examples)} warm-start examples (mean {sum(lens) / len(lens):.0f} tokens)")

    # --- model
    eos_id, pad_id = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(PAD)
    # the thinking build is Qwen3's architecture (its q/k norms, no qkv bias), the other Qwen2's
    config = (Qwen3Config if thinking else Qwen2Config)(
        vocab_size=len(tok), hidden_size=args["hidden_size"], num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"], num_key_value_heads=args["num_kv_heads"],
        intermediate_size=args["intermediate_size"], max_position_embeddings=args["max_positions"],
        rope_parameters={"rope_type": "default", "rope_theta": args["rope_theta"]},
        use_sliding_window=args["sliding_window"] is not None, sliding_window=args["sliding_window"],
        max_window_layers=0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=pad_id, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    # --- warm start
    t0 = time.time()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    losses = warm_start(model, examples, args, weights, on_step)
    timings["train_s"] = round(time.time() - t0, 2)
    model.save_pretrained(folder)
    timings["total_s"] = round(time.time() - t_start, 2)
    info = {"args": args, "tasks": tau2_env and f"{tau2_env}:train" or os.path.relpath(os.path.abspath(tasks_path), REPO),
            "preset_tasks": os.path.relpath(os.path.abspath(preset_path), REPO) if preset and preset_path else None,
            "n_examples": len(examples), "params": sum(p.numel() for p in model.parameters()),
            "loss_first": losses[0], "loss_last": losses[-1], "timings": timings}
    write_json(os.path.join(folder, "build_info.json"), info)
    _log(f"built in {timings['total_s']:.0f} s ({timings['train_s']:.0f} s training); "
         f"measure it with: python bench/tiny_measure.py")
    return info


def warm_start(model, examples, args, weights, on_step=None):
    """AdamW on the assistant tokens of the examples, drawn with `weights`; the LM head runs
    only at loss positions. `on_step(step)` is called after every optimiser step."""
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
        if on_step:
            on_step(step + 1)
    model.eval()
    return losses


# ----------------------------------------------------------------------------- cache


def build_key(tasks_path=DEFAULT_TASKS, preset_path=PRESET_TASKS, **overrides):
    """Hash of this file's source, the build arguments and the task files (a τ² build: the tasks,
    policy, tool schemas and database it learns from, as a user's own domain may change)."""
    h = hashlib.sha256()
    with open(os.path.abspath(__file__), "rb") as f:
        h.update(f.read())
    h.update(json.dumps({**DEFAULTS, **overrides}, sort_keys=True).encode())
    if overrides.get("env", "bfcl") != "bfcl":
        h.update(tau2_fingerprint(overrides["env"]))
    for path in (tasks_path, preset_path):
        if path:
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def build_cached(cache_root=None, *, tasks_path=DEFAULT_TASKS, preset_path=PRESET_TASKS, **overrides):
    """Path of the tiny model folder, built once into `<cache_root>/tiny-<hash>/` and reused.

    SEAL_TINY_SEED=K builds (and every caller then uses) the model of another seed: the way
    to check that tests and the preset hold on a build whose floats differ from this one's."""
    from filelock import FileLock
    overrides.setdefault("seed", int(os.environ.get("SEAL_TINY_SEED", DEFAULTS["seed"])))
    if overrides.get("env", "bfcl") != "bfcl":
        overrides.setdefault("steps", TAU2_STEPS)
    cache_root = cache_root or os.path.join(REPO, ".cache")
    os.makedirs(cache_root, exist_ok=True)
    path = os.path.join(cache_root, f"tiny-{build_key(tasks_path, preset_path, **overrides)}")
    done = os.path.join(path, "build_info.json")
    if os.path.isfile(done):
        return path
    with FileLock(path + ".lock"):  # another process may be building the same model
        if not os.path.isfile(done):
            _log(f"building {path}")
            build(path, tasks_path=tasks_path, preset_path=preset_path, **overrides)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description="Build the tiny offline tool-calling model (HF model folder) "
                                "and print its folder (bench/tiny_measure.py measures it).")
    p.add_argument("--out", help="build into this folder (replaced atomically); default: the cached build "
                   "(.cache/tiny-<hash>, built if missing)")
    p.add_argument("--steps", type=int, default=None, help="warm-start optimiser steps (default: "
                   f"{DEFAULTS['steps']}, a τ² build's {TAU2_STEPS})")
    p.add_argument("--seed", type=int, default=int(os.environ.get("SEAL_TINY_SEED", DEFAULTS["seed"])))
    p.add_argument("--env", default="bfcl", help="bfcl, or tau2:DOMAIN: the build whose warm start plays the "
                   "domain's tiny training tasks (loop.sh tiny --set ENV=tau2:DOMAIN builds it)")
    a = p.parse_args(argv)
    steps = a.steps if a.steps is not None else TAU2_STEPS if a.env != "bfcl" else DEFAULTS["steps"]
    if a.out:
        build(a.out, steps=steps, seed=a.seed, env=a.env)
        print(a.out)
    else:
        print(build_cached(steps=steps, seed=a.seed, env=a.env))


if __name__ == "__main__":
    main()
