"""BFCL's warm start of the tiny model (common/run/tiny.py): each task of the tiny preset (data/tiny.jsonl)
learnt from its ground-truth conversation with real tool results as rollouts show it (bfcl-eval's
QwenFCHandler prompts, token-in/token-out), in both views of the tools (plain, Ω_0's schema cue), and
`miss_share` of the time from its near miss, so that GRPO's groups are mixed (docs/learning-on-cpu.md §1a).
The BPE learns the whole train split's text.
"""

import itertools
import json
import os

from common.run.tiny import CHAT_TEMPLATE, EOS, GENERATION_PROMPT, REPO, TINY, make_examples, near_miss

DEFAULT_TASKS = os.path.join(REPO, "data", "train.jsonl")
PRESET_TASKS = os.path.join(REPO, TINY.tasks)  # the tiny preset's tasks (data/prepare.py)
DONE_ANSWER = "Done: the requested operations have been carried out."
MISSING_ANSWER = {
    "miss_func": "I cannot do this with the functions I have: the function it needs is missing.",
    "miss_param": "I cannot do this yet: some required information is missing. Please provide it.",
}
DEFAULT_MISSING = "I cannot do this: something required is missing."


class WarmStart:
    """The tiny build's data on BFCL (`args`: the build's; `thinking`: every message opens with a reasoning)."""

    steps = None  # the build's default

    def __init__(self, args):
        from common.envs.bfcl import harness as bfcl
        self.args, self.thinking = args, args["thinking"]
        self.tasks = list(bfcl.load_tasks(DEFAULT_TASKS).values())
        self.preset = list(bfcl.load_tasks(PRESET_TASKS).values())
        self.info = {"tasks": os.path.relpath(DEFAULT_TASKS, REPO), "preset_tasks": os.path.relpath(PRESET_TASKS, REPO)}

    def key(self):
        return b"".join(open(path, "rb").read() for path in (DEFAULT_TASKS, PRESET_TASKS))

    def texts(self):
        return tokenizer_texts(self.tasks, [conversation(t, thinking=self.thinking) for t in self.tasks])

    def examples(self, tok, bpe):
        """Each preset task's right conversation (1 - miss_share) and near miss (miss_share), both tool views:
        the 8 tasks are all it learns (on the whole split a 1 M model learns the format, not the calls)."""
        from common.seal import interface as omega_api
        share, examples, weights = self.args["miss_share"], [], []
        pairs = [(t, conversation(t, thinking=self.thinking), conversation(t, miss=True, thinking=self.thinking))
                 for t in self.preset]
        for omega in (None, omega_api.initial()):
            for task, right, miss in pairs:
                for msgs, w in ((right, 1.0 - share if miss else 1.0), (miss, share)):
                    if msgs is not None and w > 0:
                        ex = warm_start_examples(bpe, task, msgs, self.args["context"], omega)
                        examples += ex
                        weights += [w] * len(ex)
        return examples, weights


def conversation(task, miss=False, thinking=False):
    """The ground-truth conversation of `task` as chat messages, with real tool results: per turn the user
    message(s), one assistant message of all its calls, the tool messages and a closing answer (no ground
    truth: an answer saying what is missing). `miss`: each turn's calls are their near_miss (None where a
    turn's calls have none); `thinking`: each assistant message opens with a reasoning."""
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
    conv.add_user(0, conv.turn_messages(0, announce(0)))
    text, turn = conv.prompt(), 0
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        results = [r["content"] for r in itertools.takewhile(lambda r: r["role"] == "tool", msgs[k + 1:])]
        after = msgs[k + 1 + len(results):]
        nxt = None
        if after and after[0]["role"] == "user":
            turn += 1
            nxt = conv.turn_messages(turn, announce(turn))
        text += m["content"] + conv.continuation(results or None, [""] * len(results), nxt)
    return text.removesuffix(GENERATION_PROMPT)


def tokenizer_texts(tasks, conversations):
    """Training text for the BPE: tool docs, questions and rendered ground-truth turns, deduplicated."""
    from common.envs.bfcl import prompts

    texts = []
    for task in tasks:
        # the tool docs and held-out-tool messages as bfcl-eval's QwenFCHandler shows them
        held_out = [s for v in task["missed_function"].values() for s in v]
        texts += [json.dumps(tool) for tool in prompts.hinted(task["id"], task["tools"]) + held_out]
        texts += [prompts.new_tools_message(docs)[0]["content"] for docs in task["missed_function"].values()]
        texts += [m["content"] for msgs in task["questions"] for m in msgs]
    texts += [m["content"][:20_000] for msgs in conversations for m in msgs]
    return [s for s in dict.fromkeys(texts + [CHAT_TEMPLATE]) if s]


def assistant_spans(text):
    """Character spans [start, end) of assistant contents plus their closing <|im_end|>."""
    head = "<|im_start|>assistant\n"
    spans, pos = [], 0
    while (i := text.find(head, pos)) >= 0:
        start = i + len(head)
        pos = text.index(EOS, start) + len(EOS)
        spans.append((start, pos))
    return spans


def token_spans(enc, char_spans):
    """Token index spans matching character spans; tokens must not straddle a boundary."""
    starts = {s: i for i, (s, _) in enumerate(enc.offsets)}
    ends = {e: i + 1 for i, (_, e) in enumerate(enc.offsets)}
    out = []
    for cs, ce in char_spans:
        if cs not in starts or ce not in ends:
            raise RuntimeError(f"assistant span {cs}:{ce} does not fall on token boundaries")
        out.append((starts[cs], ends[ce]))
    return out


def warm_start_examples(bpe, task, msgs, context, omega=None):
    """Training examples (ids, loss positions, is_first_step) of one conversation, the tools as `omega` shows
    them (None: plain). The system block and the messages after it (from <|im_start|>) tokenise apart."""
    import torch

    text = render(task, msgs, omega)
    cut = text.index(EOS + "\n") + len(EOS) + 1
    if text[cut:].find("<|im_start|>") != 0:
        raise RuntimeError("the chat template's system block is not followed by <|im_start|>")
    head, enc = bpe.encode(text[:cut]).ids[-context:], bpe.encode(text[cut:])
    spans = [(s + len(head), e + len(head)) for s, e in token_spans(enc, assistant_spans(text[cut:]))]
    # an assistant message that answers a user message is the first step of its turn
    first_flags = [prev["role"] == "user" for prev, m in zip(msgs, msgs[1:], strict=False)
                   if m["role"] == "assistant"]
    return [(torch.tensor(x), torch.tensor(pos), first)
            for x, pos, first in make_examples(head + enc.ids, spans, first_flags, context)]
