"""BFCL multi-turn trajectories on the episode engine (common/engine/episode.py): the session is bfcl-eval's
executable world (harness.py); under `prompts="bfcl"` the model is shown what bfcl-eval's handler builds
(prompts.py), re-rendered whole where the handler drops reasoning the context holds (a new segment), or at
every step (`rerender`, evaluation: Rerendered). docs/prompts.md.
"""

from common.engine import episode
from common.engine.episode import PlaySpec, TemplateView  # noqa: F401 - PlaySpec: the stages' name for it
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl.prompts import Conversation, PromptIds, announced, first_prompt
from common.seal import interface as omega_api


class HandlerView:
    """What the model is shown under `prompts="bfcl"`: what bfcl-eval's handler builds from its history."""

    def __init__(self, tokenizer, task, tools, shown, system, handler):
        self.tok, self.task, self.tools, self.handler = tokenizer, task, tools, handler
        self.conv = Conversation(handler, task, shown, system)
        self.encoder = PromptIds(tokenizer)  # each prompt's ids (as vLLM's server tokenises it), reusing the last's
        self.text = self.parsed = self._closing = None  # the last prompt rendered, the handler's parse of the last output
        self.reasoning = False  # an output since the last rendering had reasoning the handler took off

    def add_user(self, turn, msgs):
        self.conv.add_user(turn, msgs)

    def prompt_ids(self):
        """The handler's rendering of the whole conversation (it can raise), as ids."""
        self.text = self.conv.prompt()
        self.reasoning = False
        return self.encoder(self.text)

    def plain_prompt_ids(self):  # encoded whole: not a prompt of this trajectory
        return self.tok(first_prompt(self.task, self.tools, handler_name=self.handler))["input_ids"]

    def closing(self):
        if self._closing is None:
            self._closing = self.conv.continuation()
        return self._closing

    def add_output(self, text, prompt_tokens=0, output_tokens=0):
        """The output into the handler's history as bfcl-eval's harness puts it (its parse: for QwenFCHandler
        the decoded calls, the reasoning apart), which a re-render shows."""
        self.parsed = self.conv.add_assistant(text, prompt_tokens, output_tokens)
        # QwenFCHandler splits off what precedes </think> (its _parse_query_response_prompting)
        self.reasoning |= self.parsed["model_responses"] != text

    def add_results(self, contents, names):
        self.conv.add_results(contents, self.parsed, names)

    def drops_reasoning(self):
        """Whether the handler's rendering at a new user turn drops reasoning the context holds:
        QwenFCHandler's _format_prompt keeps an assistant message's reasoning only after the last user query."""
        return self.reasoning

    def continuation(self, text, results, names, turn_msgs):
        return self.conv.continuation(results, names, turn_msgs)


class Trajectory(episode.Trajectory):
    """One sample of one BFCL task, token-in/token-out, on bfcl-eval's turn protocol; its view is `spec.prompts`'."""

    def __init__(self, task, sample_index, spec, tokenizer, stop_ids=(), session=None):
        super().__init__(task, sample_index, spec, tokenizer, stop_ids, session or bfcl.Environment(task))

    def make_view(self, tools, shown, system):
        if self.spec.prompts == "template":
            return TemplateView(self.tok, tools, shown, system)
        return HandlerView(self.tok, self.task, tools, shown, system, self.spec.handler)

    def turn_messages(self, turn):
        # bfcl-eval announces a held-out turn's tools (in the task's order) whatever came before
        revealed = announced(self.task, turn)
        shown = omega_api.tool_view(revealed, self.omega) if revealed is not None else None
        if isinstance(self.view, HandlerView):
            conv = self.view.conv
            return conv.turn_messages(turn, shown), conv.turn_messages(turn, revealed)
        msgs = bfcl.turn_messages(self.task, turn, new_tools=shown)
        return msgs, (bfcl.turn_messages(self.task, turn) if revealed is not None else msgs)

    def hint_rules(self):
        return HINT_RULES

    def names(self, step, n):
        names = self.env.decoded[-1][-1] if step["calls"] else []  # the handler zips results with these
        return list(names) + [""] * (n - len(names))


class Rerendered(Trajectory):
    """A trajectory played as bfcl-eval's harness plays it (`spec.rerender`, evaluation): every prompt is the
    handler's rendering of the whole history; the generated ids are only recorded."""

    def __init__(self, task, sample_index, spec, tokenizer, stop_ids=(), session=None):
        super().__init__(task, sample_index, spec, tokenizer, stop_ids, session)
        self.next_prompt = self.log.prompt_ids
        self.step_prompts = [self.view.text]  # the prompt text of every step, for bfcl-eval's result files

    def context(self):
        return self.next_prompt

    def limit(self):
        """bfcl-eval's local inference: `min(max_new_tokens, ctx - input - 2)` with the input counted by
        `tokenizer.tokenize`; a prompt with no room fails the entry (its server rejects it)."""
        n = len(self.next_prompt) - self.tok.num_special_tokens_to_add()  # = len(tokenize(prompt))
        if self.spec.max_model_len < n + 2:
            self.fail(f"the prompt ({n} tokens) does not fit the model's context ({self.spec.max_model_len})")
            return None
        return min(self.spec.max_new_tokens, self.spec.max_model_len - n - 2)

    def _take_output(self, gen, text):
        self.log.append(list(gen.ids), 1, list(gen.logprobs))
        self.view.add_output(text, len(self.next_prompt), len(gen.ids))

    def _step_log(self, gen):  # bfcl-eval's result files log these per step
        return {"formatted_prompt": self.step_prompts[-1], "prompt_tokens": len(self.next_prompt),
                "output_tokens": len(gen.ids)}

    def _next(self, text, results, names, turn_msgs):
        try:  # bfcl-eval renders the next prompt from what its handler kept; this can raise
            self.next_prompt = self.view.prompt_ids()
        except Exception as e:
            return self.fail(str(e))
        self.step_prompts.append(self.view.text)
        return None


def play(tasks, n, engine, spec, *, round_=0, policy="", progress=True):
    """Rollout records of `n` samples of every BFCL task (common/engine/episode.py play), and the timing."""
    return episode.play(tasks, n, engine, spec, bfcl.Environment, trajectory=Rerendered if spec.rerender else Trajectory,
                        round_=round_, policy=policy, progress=progress)


# ----------------------------------------------------------------------------- Ω's hints of BFCL's own classes


def _hint_path(m, tools):
    look = omega_api.pick(tools, ("pwd", "ls", "find"))
    return (f"Check where you are and what exists{look} before retrying; move one folder at a time "
            "and use names exactly as listed.")


def _hint_exists(m, tools):
    return f"That name is already taken: look at what is there{omega_api.pick(tools, ('ls',))} before retrying."


def _hint_precondition(m, tools):
    look = omega_api.pick(tools, ("Status", "display", "get_current"))
    return f"A precondition is not met: check the current state{look}, do the required step first, then retry."


# The file system's, vehicle's and trading bot's failures (common/seal/interface.py ERROR_RULES' form).
HINT_RULES = [
    ("bad_path", "env", r"(?i)no such (file|directory)|not a directory|is a directory|not a file or directory"
     r"|unsupported path|path not allowed|already the root", _hint_path),
    ("already_exists", "env", r"(?i)file exists|already exists", _hint_exists),
    ("precondition", "env", r"(?i)brake|engine|doors must be locked|fuel tank is empty|market is closed",
     _hint_precondition),
]
