"""What the model is shown: prompts built by bfcl-eval's own handler code.

bfcl-eval's local-model inference (model_handler/base_handler.py,
`inference_multi_turn_prompting`) keeps each task's conversation in the handler's
own `inference_data` and, before every model call, renders the whole of it with
the handler's `_format_prompt`. This module drives those same handler methods, on
the same data, in the same order:

- the tool docs are the task's, with bfcl-eval's language hint added to each
  description (`add_language_specific_hint_to_function_doc`, as `load_dataset_entry`
  does; held-out docs get none, as there);
- `_pre_query_processing_prompting`, `add_first_turn_message_prompting` and
  `_add_next_turn_user_message_prompting` build the messages; a held-out turn is
  announced with DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING formatted
  with the docs themselves (a Python list repr), as the harness writes it;
- a model output goes in through `_parse_query_response_prompting` and
  `_add_assistant_message_prompting` (QwenFCHandler keeps the decoded tool calls,
  not the text), execution results through `_add_execution_results_prompting`.

Only the calls themselves differ from bfcl-eval's harness: they are parsed and
executed by common.engine.calls / common.envs.bfcl.harness (nothing a model writes is eval'd), and
those results are what goes in.

Two ways to turn that into token ids:

- `rerender=True` (evaluation): every prompt is `_format_prompt` of the whole
  history, tokenised as the vLLM server bfcl-eval talks to tokenises it;
- `rerender=False` (training, token-in/token-out): the first prompt as above, then
  the model's own ids stay in the context and only what the handler adds after them
  is rendered and tokenised (the one difference from evaluation: the model sees its
  own text, not the handler's re-rendering of its decoded calls).
"""

import copy
import functools
import importlib
import types

from common.envs.bfcl import (
    harness as bfcl,  # sets BFCL_PROJECT_ROOT before anything of bfcl-eval is imported
)
from common.presets import HANDLER

# The bfcl-eval handlers this project drives: (module, registry entry, call format). The
# registry entry is the bfcl-eval model whose result files (common/envs/bfcl/results.py) these
# prompts correspond to. bfcl-eval 2026.3.23 lists no Qwen2.5: QwenFCHandler is registered
# for the Qwen3 FC entries, and Qwen2.5 runs through it with --local-model-path.
HANDLERS = {
    "QwenFCHandler": ("bfcl_eval.model_handler.local_inference.qwen_fc", "Qwen/Qwen3-8B-FC", "json"),
    # ToolACE-2-8B's own entry: prompting mode, bfcl-eval's default system prompt.
    "LlamaHandler": ("bfcl_eval.model_handler.local_inference.llama", "Team-ACE/ToolACE-2-8B", "python"),
}
SENTINEL = "SEALSENTINEL7f3a"  # marks a cut point in a rendered probe (no whitespace: handlers strip contents)


class HandlerError(ValueError):
    """A handler name this project does not drive."""


def check_handler(name):
    if name not in HANDLERS:
        raise HandlerError(f"unknown bfcl-eval handler {name!r}; choices: {', '.join(HANDLERS)}")
    return name


def registry_name(name):
    return HANDLERS[check_handler(name)][1]


def call_format(name, fmt=""):
    """How handler `name`'s prompts ask the model to write calls. A format `fmt` given besides must be
    that one: any other would mis-decode every output, with no error."""
    own = HANDLERS[check_handler(name)][2]
    if fmt and fmt != own:
        raise HandlerError(f"call format {fmt} contradicts {name}, whose prompts ask for {own} calls "
                           f"(leave the call format unset: it follows the handler)")
    return own


@functools.cache
def handler(name):
    """The bfcl-eval handler instance (its prompting methods keep no state of their own)."""
    module, registry, _ = HANDLERS[check_handler(name)]
    cls = getattr(importlib.import_module(module), name)
    # model_name as the registry gives it; the temperature is bfcl-eval's default (it only
    # reaches the server request, which the engine makes here).
    model = registry[:-3] if registry.endswith("-FC") else registry
    return cls(model_name=model, temperature=0.001, registry_name=registry, is_fc_model=registry.endswith("-FC"))


def hinted(task_id, docs):
    """Tool docs with bfcl-eval's language-specific hint, by bfcl-eval's own function."""
    from bfcl_eval.utils import add_language_specific_hint_to_function_doc
    return add_language_specific_hint_to_function_doc([{"id": task_id, "function": copy.deepcopy(docs)}])[0]["function"]


def new_tools_message(docs):
    """The user message that announces held-out tools, as bfcl-eval's harness writes it."""
    return [{"role": "user", "content": bfcl.NEW_TOOLS_TEMPLATE.format(functions=docs)}]


def response(text, prompt_tokens=0, output_tokens=0):
    """A completion as bfcl-eval's handler reads it from the OpenAI client (text and usage)."""
    return types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)],
                                 usage=types.SimpleNamespace(prompt_tokens=prompt_tokens,
                                                             completion_tokens=output_tokens))


def announced(task, turn):
    """The held-out docs bfcl-eval's harness announces at `turn`, or None (no announcement)."""
    return task["missed_function"].get(str(turn))


def first_prompt(task, tools=None, system=None, handler_name=HANDLER):
    """The prompt text of a task's first model call (the task's own tools unless `tools`)."""
    conv = Conversation(handler_name, task, task["tools"] if tools is None else tools, system)
    conv.add_user(0, conv.turn_messages(0, announced(task, 0)))
    return conv.prompt()


class Conversation:
    """One task's conversation in bfcl-eval's handler format.

        conv = Conversation("QwenFCHandler", task, tools, system=None)
        conv.add_user(turn, messages)          # a turn's user messages (or the held-out-tools message)
        text = conv.prompt()                   # _format_prompt of everything so far
        parsed = conv.add_assistant(text)      # bfcl-eval's parse of one model output
        conv.add_results(contents, parsed, call_strings)
    """

    def __init__(self, handler_name, task, tools, system=None):
        self.h = handler(handler_name)
        questions = copy.deepcopy(task["questions"])
        if system:  # Ω's capability cues: a system message the handler places as any other
            questions[0] = [{"role": "system", "content": system}] + questions[0]
        entry = {"id": task["id"], "function": hinted(task["id"], tools), "question": questions}
        self.data = self.h._pre_query_processing_prompting(entry)
        self.questions = entry["question"]  # the handler may have added its system prompt to turn 0

    def turn_messages(self, turn, new_tools=None):
        """The user messages of `turn`: the task's, or the held-out tools' announcement."""
        if new_tools is not None:
            return new_tools_message(new_tools)
        return self.questions[turn]

    def add_user(self, turn, messages):
        if turn == 0:
            self.data = self.h.add_first_turn_message_prompting(self.data, messages)
        else:
            self.data = self.h._add_next_turn_user_message_prompting(self.data, messages)

    def prompt(self):
        return self.h._format_prompt(self.data["message"], self.data["function"])

    def add_assistant(self, text, prompt_tokens=0, output_tokens=0):
        parsed = self.h._parse_query_response_prompting(response(text, prompt_tokens, output_tokens))
        self.data = self.h._add_assistant_message_prompting(self.data, parsed)
        return parsed

    def add_results(self, contents, parsed, call_strings):
        parsed = {**parsed, "model_responses_decoded": list(call_strings)}
        self.data = self.h._add_execution_results_prompting(self.data, list(contents), parsed)

    def continuation(self, results=None, call_strings=(), turn_messages=None):
        """The text the handler writes after an assistant message: its closing, the tool
        responses `results` (if any), the user messages of a new turn (if any), and the
        generation prompt. Rendered on a probe conversation (a user message, then an assistant
        message holding SENTINEL) with the handler's own methods, cut after the sentinel."""
        probe = Conversation.__new__(Conversation)
        probe.h = self.h
        probe.data = {"message": [{"role": "user", "content": "u"}], "function": []}
        probe.data["message"].append({"role": "assistant", "content": SENTINEL})
        if results is not None:
            probe.add_results(results, {"model_responses": SENTINEL}, call_strings)
        if turn_messages is not None:
            probe.data = self.h._add_next_turn_user_message_prompting(probe.data, copy.deepcopy(turn_messages))
        text = probe.prompt()
        if text.count(SENTINEL) != 1:
            raise ValueError(f"{type(self.h).__name__}: the probe's assistant message is not rendered once")
        return text[text.index(SENTINEL) + len(SENTINEL):]


class PromptIds:
    """The ids of each re-rendered prompt of one trajectory, as vLLM's server tokenises a
    completion request's text (`tokenizer(text)["input_ids"]`), without re-encoding the history.

        ids = PromptIds(tokenizer)
        ids(prompt_0); ids(prompt_1); ...   # each equals tokenizer(prompt_k)["input_ids"]

    Re-encoding every step's whole prompt is quadratic in a trajectory's length (at the
    long-context tasks' ~37k tokens, most of the CPU of playing them). A fast tokenizer cuts
    a text at its added tokens before anything else and encodes the pieces apart, so a
    prompt's ids are the previous prompt's ids up to the last added token where the two texts
    still agree, then the ids of the rest (no special tokens added: they belong to the start).
    Only added tokens that strip no whitespace and are matched on the raw text serve as cuts;
    a slow tokenizer, or a prompt that agrees with the last one on no cut, is encoded whole.
    tests/test_prompts.py checks equality with whole encodes on every step of held-in plays.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        added = tokenizer.added_tokens_decoder if getattr(tokenizer, "is_fast", False) else {}
        self.marks = {i for i, a in added.items() if not (a.lstrip or a.rstrip or a.normalized)}
        self.text, self.ids, self.cuts = "", [], []  # cuts: (character, token index) of each mark

    def __call__(self, text):
        for pos, j in reversed(self.cuts):
            if j and text.startswith(self.text[:pos]):
                break
        else:
            pos = j = 0
        if j:
            enc = self.tok(text[pos:], add_special_tokens=False, return_offsets_mapping=bool(self.marks))
            ids, cuts = self.ids[:j] + enc["input_ids"], [c for c in self.cuts if c[1] < j]
        else:
            enc = self.tok(text, return_offsets_mapping=bool(self.marks))
            ids, cuts = list(enc["input_ids"]), []
        if self.marks:
            start = len(ids) - len(enc["input_ids"])
            cuts += [(pos + s, start + k) for k, (i, (s, e)) in enumerate(zip(enc["input_ids"], enc["offset_mapping"],
                                                                                 strict=True))
                     if i in self.marks and e > s]
        self.text, self.ids, self.cuts = text, ids, cuts
        return list(ids)
