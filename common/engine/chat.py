"""Conversations rendered by the model's own chat template (`--prompts template`, verl's convention).

Token-in/token-out: the ids the engine produced are kept as they are and never
re-rendered. Everything the environment adds (tool responses, the next user turn,
the generation prompt) is rendered by the chat template as the text it would add
to the conversation, and only that text is tokenised, so the context is always
exactly what the engine consumed.
"""

import json

JSON_TYPES = {"dict": "object", "float": "number", "any": "string", "tuple": "array"}


def to_chat_tools(schemas):
    """BFCL tool docs -> the JSON-schema `tools=` form chat templates expect."""
    return [{"type": "function",
             "function": {"name": s["name"], "description": s.get("description", ""),
                          "parameters": _json_schema(s["parameters"])}} for s in schemas]


def _json_schema(node):
    out = {}
    for key, value in node.items():
        if key == "type":
            out[key] = JSON_TYPES.get(value, value)
        elif key == "properties":
            out[key] = {k: _json_schema(v) for k, v in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = _json_schema(value)
        else:
            out[key] = value
    return out


class Renderer:
    """Renders message deltas of one conversation with a tokenizer's chat template."""

    def __init__(self, tokenizer, tools, system=None):
        self.tok = tokenizer
        self.tools = to_chat_tools(tools)
        self.head = [{"role": "system", "content": system}] if system else []

    def text(self, messages, generation_prompt):
        return self.tok.apply_chat_template(self.head + messages, tools=self.tools, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def ids(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages):
        """Ids of the opening context, ending with the generation prompt."""
        return self.ids(self.text(messages, True))

    def continuation_text(self, history, content, new_messages):
        """The text that follows a model output `content` (already in the context as generated ids).

        `history` is the conversation before that assistant message. The result closes
        the assistant message as the template would, then adds `new_messages` and the
        generation prompt.
        """
        before = self.text(history, True)
        closed = self.text(history + [{"role": "assistant", "content": content}], False)
        after = self.text(history + [{"role": "assistant", "content": content}] + new_messages, True)
        if not closed.startswith(before + content) or not after.startswith(closed):
            raise ValueError("chat template does not render conversations incrementally")
        return closed[len(before) + len(content):] + after[len(closed):]

    def closing(self):
        """The text the template closes an assistant message with (and the generation prompt)."""
        return self.continuation_text([{"role": "user", "content": "u"}], "x", [])


def kept_output(tok, gen, stop_ids, closing):
    """(ids, logprobs, stop text) of a generation as a token-in/token-out context keeps it.

    A final stop id stays only if it is how the prompt format itself closes an assistant
    message (`closing`, e.g. Qwen's <|im_end|>): then its text is returned, and the caller
    drops it from the rendered closing. Another stop id (Qwen2.5's <|endoftext|>, Llama's
    <|eom_id|>) is not part of the conversation: it leaves the context (and is not trained
    on) and the format's own closing follows instead.
    """
    ids, logprobs = list(gen.ids), list(gen.logprobs)
    if gen.finish == "stop" and ids and ids[-1] in stop_ids:
        stop_text = tok.decode(ids[-1:], skip_special_tokens=False)
        if closing.startswith(stop_text):
            return ids, logprobs, stop_text
        return ids[:-1], logprobs[:-1], ""
    return ids, logprobs, ""


def after_stop(text, stop_text):
    """`text` (what follows an assistant message) minus the stop text the model already wrote."""
    return text[len(stop_text):] if stop_text and text.startswith(stop_text) else text


def tool_messages(results):
    """One tool message per call result, in call order."""
    return [{"role": "tool", "content": r if isinstance(r, str) else json.dumps(r)} for r in results]
