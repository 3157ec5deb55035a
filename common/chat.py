"""Conversations as token ids, rendered by the model's own chat template.

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
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""

    def text(self, messages, generation_prompt):
        return self.tok.apply_chat_template(self.head + messages, tools=self.tools, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def ids(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages):
        """Ids of the opening context, ending with the generation prompt."""
        return self.ids(self.text(messages, True))

    def continuation(self, history, content, ended_with_eos, new_messages):
        """Ids that follow a model output `content` (already in the context as generated ids).

        `history` is the conversation before that assistant message. The result closes
        the assistant message as the template would (without a second eos if the model
        wrote one), then adds `new_messages` and the generation prompt.
        """
        before = self.text(history, True)
        closed = self.text(history + [{"role": "assistant", "content": content}], False)
        after = self.text(history + [{"role": "assistant", "content": content}] + new_messages, True)
        if not closed.startswith(before + content) or not after.startswith(closed):
            raise ValueError("chat template does not render conversations incrementally")
        closing = closed[len(before) + len(content):]
        if ended_with_eos and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self.ids(closing + after[len(closed):])


def tool_messages(results):
    """One tool message per call result, in call order."""
    return [{"role": "tool", "content": r if isinstance(r, str) else json.dumps(r)} for r in results]
