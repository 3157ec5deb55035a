"""What the model is shown: prompts built by bfcl-eval's own handler code (its local-model multi-turn loop),
driven in bfcl-eval's order; only the calls are parsed and run here, never eval'd (docs/prompts.md).
"""

import copy
import functools
import importlib
import types

from common.engine.episode import HandlerError
from common.envs.bfcl import harness as bfcl  # sets BFCL_PROJECT_ROOT before bfcl-eval is imported
from common.presets import HANDLER

# The bfcl-eval handlers driven here: (module, the registry entry whose result files these prompts match).
# bfcl-eval lists no Qwen2.5: it runs through QwenFCHandler (the Qwen3 FC entries) with --local-model-path.
HANDLERS = {
    "QwenFCHandler": ("bfcl_eval.model_handler.local_inference.qwen_fc", "Qwen/Qwen3-8B-FC"),
    # ToolACE-2-8B's own entry: prompting mode, bfcl-eval's default system prompt.
    "LlamaHandler": ("bfcl_eval.model_handler.local_inference.llama", "Team-ACE/ToolACE-2-8B"),
}
SENTINEL = "SEALSENTINEL7f3a"  # marks a cut point in a rendered probe (no whitespace: handlers strip contents)


def check_handler(name):
    if name not in HANDLERS:
        raise HandlerError(f"unknown bfcl-eval handler {name!r}; choices: {', '.join(HANDLERS)}")
    return name


def registry_name(name):
    return HANDLERS[check_handler(name)][1]


@functools.cache
def handler(name):
    """The bfcl-eval handler instance (its prompting methods keep no state of their own)."""
    module, registry = HANDLERS[check_handler(name)]
    cls = getattr(importlib.import_module(module), name)
    # the temperature is bfcl-eval's default: it only reaches the server request, made here by the engine
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
    return types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)], usage=types.SimpleNamespace(
        prompt_tokens=prompt_tokens, completion_tokens=output_tokens))


def announced(task, turn):
    """The held-out docs bfcl-eval's harness announces at `turn`, or None (no announcement)."""
    return task["missed_function"].get(str(turn))


def first_prompt(task, tools=None, system=None, handler_name=HANDLER):
    """The prompt text of a task's first model call (the task's own tools unless `tools`)."""
    conv = Conversation(handler_name, task, task["tools"] if tools is None else tools, system)
    conv.add_user(0, conv.turn_messages(0, announced(task, 0)))
    return conv.prompt()


class Conversation:
    """One task's conversation in the handler's own `inference_data`: add_user, prompt, add_assistant, add_results."""

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
        return self.questions[turn] if new_tools is None else new_tools_message(new_tools)

    def add_user(self, turn, messages):
        h = self.h
        add = h.add_first_turn_message_prompting if turn == 0 else h._add_next_turn_user_message_prompting
        self.data = add(self.data, messages)

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
        """The handler's text after an assistant message (results, a new turn, the generation prompt)."""
        probe = copy.copy(self)  # the same handler, another history
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
    """Each re-rendered prompt's tokenizer(text) ids, re-encoding only past the last shared added token."""

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
            pairs = enumerate(zip(enc["input_ids"], enc["offset_mapping"], strict=True))
            cuts += [(pos + s, start + k) for k, (i, (s, e)) in pairs if i in self.marks and e > s]
        self.text, self.ids, self.cuts = text, ids, cuts
        return list(ids)
