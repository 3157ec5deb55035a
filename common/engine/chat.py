"""Conversations rendered by the model's own chat template (`--prompts template`, verl's convention).

Token-in/token-out (docs/prompts.md): the engine's ids are never re-rendered; only the text the template
adds after them (tool responses, the next user turn, the generation prompt) is tokenised.
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
        """The text after the model output `content` that followed `history`: the assistant message's
        closing as the template writes it, `new_messages` and the generation prompt."""
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
    """(ids, logprobs, stop text) of a generation as a token-in/token-out context keeps it: a final stop
    id stays only where `closing` starts with it (Qwen's <|im_end|>; the caller drops its text from the
    closing); another (Qwen2.5's <|endoftext|>) leaves the context, as docs/prompts.md says."""
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
