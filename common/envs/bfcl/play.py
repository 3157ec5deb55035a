"""The multi-turn BFCL protocol, played by a policy engine for many trajectories at once.

For each user turn the model answers; parsed calls are executed as bfcl-eval's
harness executes them (common/envs/bfcl/harness.py) and their results fed back as tool
responses. The turn protocol is bfcl-eval's multi-turn inference loop
(model_handler/base_handler.py):

- the turn ends when an output has no calls: a plain answer (`end: "answer"`), or
  an output that does not decode into calls (`end: "decode_error"`, no retry);
- after a step with calls, if the turn has had more than `max_steps_per_turn` of
  them (the 21st of 20), the task is force-quit (`stop: "step_limit"`).

One part of that belongs to Ω in training: with its error feedback on, an
undecodable output is answered with the parse error and its hint and the turn goes
on (it counts as a step). The record's `decode_failure` says which rule applied:
"end_turn" (evaluation, Ω absent or error feedback off) or "feedback".

Two schedules give the same records at temperature 0 (same ids, masks, calls,
results): "lockstep" advances all trajectories waiting for the model together,
one batched engine call per step, so each step waits for its longest generation;
"async" (vLLM only: the engine's submit/poll) submits a trajectory's next
generation as soon as its previous one is parsed, executed and its continuation
appended, and the engine's continuous batching keeps the batch full. A failure
while handling one trajectory aborts the engine's queued requests and raises
TrajectoryFailed naming the task and sample.

    spec = PlaySpec(omega=omega, temperature=1.0, schedule="async")  # common/engine/playargs.py: from flags
    records, timing = play(tasks, n, engine, spec, round_=t, policy=model_dir)

rollout.py, evaluate.py and ood/memory.py are thin command lines around `play`.
"""

import collections
import dataclasses
import time

from tqdm import tqdm

from common import presets
from common.engine.chat import Renderer, after_stop, kept_output, tool_messages
from common.engine.engines import sampling_params
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl.prompts import Conversation, PromptIds, announced, call_format, first_prompt
from common.seal import interface as omega_api


@dataclasses.dataclass(frozen=True)
class PlaySpec:
    """How every trajectory of a play is played, built once per stage from its flags (common/engine/playargs.py),
    whose defaults are these: the presets' (common/presets.py).

    omega                Ω (interface.json), or None: plain prompts, bfcl-eval's decode-failure rule
    fmt                  how calls are decoded: json (<tool_call> blocks) or python ([f(a=1)] lists);
                         empty: as `handler`'s prompts ask, and refused where it contradicts them
    temperature          what the engine samples with: a temperature, or a dict of SAMPLING_KEYS
    max_steps_per_turn   a turn's step with calls past this many force-quits the task
    max_model_len        the context in tokens; max_new_tokens: the cap per model call
    schedule             "lockstep" (one batched call per step) or "async" (per trajectory, vLLM)
    prompts, handler     what the model is shown: "bfcl", the prompts bfcl-eval's `handler` builds
                         (common/envs/bfcl/prompts.py), or "template", the model's own chat template with
                         `tools=` (verl's convention; common/engine/chat.py)
    rerender             every prompt is the handler's rendering of the whole history, as
                         bfcl-eval's harness sends it (evaluation); otherwise the generated ids
                         stay in the context (token-in/token-out) and only what follows is rendered
    """

    omega: dict | None = None
    fmt: str = ""
    temperature: float | dict = presets.TEMPERATURE
    max_steps_per_turn: int = presets.MAX_STEPS_PER_TURN
    max_model_len: int | None = presets.MAX_MODEL_LEN
    max_new_tokens: int = presets.MAX_NEW_TOKENS
    schedule: str = "lockstep"
    prompts: str = presets.PROMPTS
    handler: str = presets.HANDLER
    rerender: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fmt", call_format(self.handler, self.fmt))  # frozen: set once, here
        if self.schedule not in ("lockstep", "async"):
            raise ValueError(f"unknown schedule {self.schedule!r} (lockstep or async)")
        if self.prompts not in ("bfcl", "template"):
            raise ValueError(f"unknown prompt format {self.prompts!r} (bfcl or template)")
        if self.rerender and self.prompts != "bfcl":
            raise ValueError("re-rendered prompts are bfcl-eval's (prompts='bfcl')")


class TemplateView:
    """What the model is shown under `prompts="template"`: its own chat template, the
    conversation kept as messages."""

    def __init__(self, tokenizer, task, tools, shown, system, handler):
        self.tok, self.task, self.tools = tokenizer, task, tools
        self.renderer, self.history, self.before = Renderer(tokenizer, shown, system), [], None

    def enter_turn(self, turn, shown, revealed):
        """The user messages of `turn` (new tools as `shown`), and the same without Ω's cues."""
        msgs = bfcl.turn_messages(self.task, turn, new_tools=shown)
        self.history += msgs
        return msgs, (bfcl.turn_messages(self.task, turn) if revealed is not None else msgs)

    def prompt_ids(self):
        return self.renderer.prompt(self.history)

    def plain_prompt_ids(self):
        """The first prompt without Ω's cues."""
        return Renderer(self.tok, self.tools).prompt(self.history)

    def closing(self):
        return self.renderer.closing()

    def add_output(self, text, prompt_tokens=0, output_tokens=0):
        self.before = list(self.history)
        self.history.append({"role": "assistant", "content": text})

    def add_results(self, contents, names):
        self.history += tool_messages(contents)

    def drops_reasoning(self):
        return False

    def continuation(self, text, results, names, turn_msgs):
        """The text that follows the model's output `text`: what came back, and a new turn's messages."""
        new = (tool_messages(results) if results is not None else []) + (turn_msgs or [])
        return self.renderer.continuation_text(self.before, text, new)


class HandlerView:
    """What the model is shown under `prompts="bfcl"`: what bfcl-eval's handler builds, the
    conversation kept as the handler keeps it (common/envs/bfcl/prompts.py)."""

    def __init__(self, tokenizer, task, tools, shown, system, handler):
        self.tok, self.task, self.tools, self.handler = tokenizer, task, tools, handler
        self.conv = Conversation(handler, task, shown, system)
        self.encoder = PromptIds(tokenizer)  # each prompt's ids, reusing the last prompt's
        self.text = None  # the last prompt rendered
        self.parsed = None  # the handler's parse of the last output
        self.reasoning = False  # an output since the last rendering had reasoning the handler took off

    def enter_turn(self, turn, shown, revealed):
        msgs = self.conv.turn_messages(turn, shown)
        plain = self.conv.turn_messages(turn, revealed)
        self.conv.add_user(turn, msgs)
        return msgs, plain

    def prompt_ids(self):
        """The handler's rendering of the whole conversation (it can raise), as ids."""
        self.text = self.conv.prompt()
        self.reasoning = False
        return self._encode(self.text)

    def _encode(self, text):
        """Ids of a whole prompt, as vLLM's server tokenises a completion request's text."""
        return self.encoder(text)

    def plain_prompt_ids(self):  # encoded whole: not a prompt of this trajectory
        return self.tok(first_prompt(self.task, self.tools, handler_name=self.handler))["input_ids"]

    def closing(self):
        return self.conv.continuation()

    def add_output(self, text, prompt_tokens=0, output_tokens=0):
        """The output into the handler's history as bfcl-eval's harness puts it (its parse: for
        QwenFCHandler the decoded calls, the reasoning apart), which a re-render shows."""
        self.parsed = self.conv.add_assistant(text, prompt_tokens, output_tokens)
        # QwenFCHandler splits off what precedes </think> (its _parse_query_response_prompting)
        self.reasoning |= self.parsed["model_responses"] != text

    def add_results(self, contents, names):
        self.conv.add_results(contents, self.parsed, names)

    def drops_reasoning(self):
        """Whether the handler's rendering at a new user turn drops reasoning the context holds:
        QwenFCHandler's _format_prompt keeps an assistant message's reasoning only after the
        last user query, so the next prompt does not extend the generated tokens."""
        return self.reasoning

    def continuation(self, text, results, names, turn_msgs):
        return self.conv.continuation(results, names, turn_msgs)


def cut_stops(short_context):
    """The stops of a BFCL rollout that are not the policy's failure under evaluation's rules
    (common/envs/__init__.py): bfcl-eval's inference error (the next prompt could not be built), and the
    context limit where the rollouts' context is shorter than evaluation's. The step limit is
    bfcl-eval's own: the policy's failure."""
    return {"inference_error"} | ({"context_limit"} if short_context else set())


class Trajectory:
    """One sample of one task, token-in/token-out: its environment, what the model is shown
    (the view of `spec.prompts`), and the record. The generated ids stay in the context and
    only what follows them is rendered, except where bfcl-eval's handler drops reasoning the
    context holds (a thinking model's new user turn): there the context is the handler's
    rendering of the whole history, as evaluation shows it, and a new segment of the record
    starts (docs/design.md §3)."""

    def __init__(self, task, sample_index, spec, tokenizer, stop_ids=()):
        self.task, self.sample_index, self.spec, self.omega = task, sample_index, spec, spec.omega
        self.tok, self.stop_ids = tokenizer, set(stop_ids)
        self.decode_failure = "feedback" if self.omega and self.omega["error_feedback"] else "end_turn"
        self.env = bfcl.Environment(task)
        self.start = time.perf_counter()
        self.cue_tokens = 0
        self.turns = []
        self.stop = None
        self.error = None  # bfcl-eval's inference error: the entry failed as a whole
        self.closing = None  # how the format closes an assistant message
        tools = bfcl.tools_at(task, 0)
        shown, system = omega_api.tool_view(tools, self.omega), omega_api.system_cue(self.omega)
        self.ids, self.mask, self.logprobs = [], [], []
        self.segments = []  # the record's finished segments; the current one is prompt_ids, ids, ...
        self.segment_turn = 0  # the turn the current segment starts at
        view = TemplateView if spec.prompts == "template" else HandlerView
        self.view = view(tokenizer, task, tools, shown, system, spec.handler)
        self._enter_turn(0)
        self.prompt_ids = self.next_prompt = self.view.prompt_ids()
        if shown is not tools or system:
            # Schema-cue annotations and capability cues: what the prompt has beyond the plain one.
            self.cue_tokens += max(0, len(self.prompt_ids) - len(self.view.plain_prompt_ids()))

    def _enter_turn(self, turn):
        """Start `turn` in the environment; returns its user messages (new tools announced)."""
        self.env.start_turn(turn)
        # bfcl-eval announces a held-out turn's tools (in the task's order) whatever came before
        revealed = announced(self.task, turn)
        shown = omega_api.tool_view(revealed, self.omega) if revealed is not None else None
        msgs, plain = self.view.enter_turn(turn, shown, revealed)
        if msgs is not plain:
            # Schema-cue annotations of revealed tools are cue tokens too.
            self.cue_tokens += max(0, len(self.tok(msgs[0]["content"], add_special_tokens=False)["input_ids"])
                                   - len(self.tok(plain[0]["content"], add_special_tokens=False)["input_ids"]))
        self.turns.append({"steps": [], "end": None})
        return msgs

    def context(self):
        """The ids the engine gets for this trajectory's next output."""
        return self.prompt_ids + self.ids

    def context_len(self):
        return len(self.prompt_ids) + len(self.ids)

    def _append(self, ids, mask, logprobs=None):
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [None] * len(ids)

    def finish(self, stop, end=None):
        self.stop = stop
        if end and self.turns and self.turns[-1]["end"] is None:
            self.turns[-1]["end"] = end
        self.env.close()

    def fail(self, error):
        """bfcl-eval's inference error (its next prompt could not be built or sent): the
        harness records the exception and the entry is scored as failed."""
        self.error = error
        self.finish("inference_error", "inference_error")

    def limit(self):
        """The generation limit of the next call (what is left of the context), or None once
        the trajectory has stopped on it."""
        room = self.spec.max_model_len - self.context_len()
        if room > 0:
            return min(self.spec.max_new_tokens, room)
        self.finish("context_limit", "context_limit")
        return None

    def advance(self, gen, text):
        """Take one model output: execute its calls and add what the model sees next."""
        stop_text = self._take_output(gen, text)
        step = {"text": text, **self.env.step(text, self.spec.fmt), "feedback": None, **self._step_log(gen)}
        turn = self.turns[-1]
        turn["steps"].append(step)
        action = turn_action(step, len(turn["steps"]), self.decode_failure, self.spec.max_steps_per_turn)
        if action == "force_quit":
            return self.finish("step_limit", "step_limit")
        results, names, turn_msgs = None, (), None
        if action == "continue":
            contents = list(step["results"])
            # bfcl-eval shows only the results of the calls it decoded (a skipped <tool_call>
            # block goes unmentioned); telling the model about it is Ω's error feedback.
            if step["parse_error"] and self.decode_failure == "feedback":
                contents.append(f"Error: could not parse tool calls: {step['parse_error']}")
            hints = []
            for i, err in enumerate(hint_errors(step)[:len(contents)]):
                hint = omega_api.error_hint(err, self.env.tools, self.omega) if err else None
                if hint:
                    contents[i] = f"{contents[i]}\n{hint}"
                    hints.append(hint)
                    self.cue_tokens += len(self.tok(hint, add_special_tokens=False)["input_ids"])
            step["feedback"] = "\n".join(hints) or None
            results = contents
            names = self.env.decoded[-1][-1] if step["calls"] else []
            names = list(names) + [""] * (len(contents) - len(names))  # the handler zips results with them
            self._add_results(contents, names)
        else:
            turn["end"] = "decode_error" if step["parse_error"] else "answer"
            if len(self.turns) == len(self.task["questions"]):
                return self.finish("done")
            turn_msgs = self._enter_turn(len(self.turns))
        return self._next(text, stop_text, results, names, turn_msgs)

    def _take_output(self, gen, text):
        """Append the generated ids as the context keeps them; returns the stop text kept."""
        if self.closing is None:  # the same for every message of the conversation: rendered once
            self.closing = self.view.closing()
        self.view.add_output(text, self.context_len(), len(gen.ids))
        ids, logprobs, stop_text = kept_output(self.tok, gen, self.stop_ids, self.closing)
        self._append(ids, 1, logprobs)
        return stop_text

    def _step_log(self, gen):
        return {}

    def _add_results(self, contents, names):
        self.view.add_results(contents, names)

    def _next(self, text, stop_text, results, names, turn_msgs):
        """Append what the model sees after its output `text`, unless it does not fit."""
        if turn_msgs is not None and self.view.drops_reasoning():
            return self._rerender()
        more_text = self.view.continuation(text, results, names, turn_msgs)
        more = self.tok(after_stop(more_text, stop_text), add_special_tokens=False)["input_ids"]
        if self.context_len() + len(more) >= self.spec.max_model_len:
            # What the model would see next does not fit (with room for one token).
            return self.finish("context_limit", "context_limit")
        self._append(more, 0)
        return None

    def _rerender(self):
        """Go on from the handler's rendering of the whole history (evaluation's prompt at this
        step) in a new segment, unless it cannot be built (bfcl-eval's inference error) or fit."""
        try:
            prompt = self.view.prompt_ids()
        except Exception as e:
            return self.fail(str(e))
        if len(prompt) >= self.spec.max_model_len:
            return self.finish("context_limit", "context_limit")
        self.segments.append(self._segment())
        self.prompt_ids, self.ids, self.mask, self.logprobs = prompt, [], [], []
        self.segment_turn = len(self.turns) - 1
        return None

    def _segment(self):
        seg = {"turn": self.segment_turn} if self.segment_turn else {}  # the first starts the task
        return seg | {"prompt_ids": self.prompt_ids, "ids": self.ids, "mask": self.mask, "logprobs": self.logprobs}

    def record(self, round_, policy):
        first, *more = segments = self.segments + [self._segment()]
        tokens = first | ({"segments": more} if more else {})
        rec = {
            "task_id": self.task["id"], "category": self.task["category"], "sample_index": self.sample_index,
            "round": round_, "policy": policy,
            "interface_version": self.omega.get("version") if self.omega else None,
            "turns": self.turns, "stop": self.stop, "decode_failure": self.decode_failure,
            "tokens": tokens,
            "stats": {"gen_tokens": sum(sum(seg["mask"]) for seg in segments), "cue_tokens": self.cue_tokens,
                      "seconds": round(time.perf_counter() - self.start, 3)},
        }
        if self.error is not None:
            rec["inference_error"] = self.error
        return rec


class Rerendered(Trajectory):
    """A trajectory played as bfcl-eval's harness plays it (`spec.rerender`, evaluation): every
    prompt is the handler's rendering of the whole history; the generated ids are only recorded."""

    def __init__(self, task, sample_index, spec, tokenizer, stop_ids=()):
        super().__init__(task, sample_index, spec, tokenizer, stop_ids)
        self.step_prompts = [self.view.text]  # the prompt text of every step, for bfcl-eval's result files

    def context(self):
        return self.next_prompt

    def limit(self):
        """bfcl-eval's local inference: `min(max_new_tokens, ctx - input - 2)` with the input counted
        by `tokenizer.tokenize`; a prompt with no room fails the entry (its server rejects it)."""
        n = len(self.next_prompt) - self.tok.num_special_tokens_to_add()  # = len(tokenize(prompt))
        if self.spec.max_model_len < n + 2:
            self.fail(f"the prompt ({n} tokens) does not fit the model's context ({self.spec.max_model_len})")
            return None
        return min(self.spec.max_new_tokens, self.spec.max_model_len - n - 2)

    def _take_output(self, gen, text):
        self._append(list(gen.ids), 1, list(gen.logprobs))
        self.view.add_output(text, len(self.next_prompt), len(gen.ids))
        return ""

    def _step_log(self, gen):  # bfcl-eval's result files log these per step
        return {"formatted_prompt": self.step_prompts[-1], "prompt_tokens": len(self.next_prompt),
                "output_tokens": len(gen.ids)}

    def _next(self, text, stop_text, results, names, turn_msgs):
        try:  # bfcl-eval renders the next prompt from what its handler kept; this can raise
            self.next_prompt = self.view.prompt_ids()
        except Exception as e:
            return self.fail(str(e))
        self.step_prompts.append(self.view.text)
        return None


def turn_action(step, steps_in_turn, decode_failure, max_steps_per_turn):
    """What bfcl-eval's inference loop does after a step (the `steps_in_turn`-th of its turn):

    "end_turn"    no calls: a plain answer, or an undecodable output under the "end_turn" rule;
    "force_quit"  calls ran and the turn has now had more than `max_steps_per_turn` steps
                  (bfcl-eval counts a step after running its calls: with 20, the 21st quits);
    "continue"    the results (or, under the "feedback" rule, the parse error) go back to the model.

    Every step but a turn's last has calls (or was answered with feedback), so the step's
    position in its turn is bfcl-eval's count.
    """
    if not step["calls"] and not (step["parse_error"] and decode_failure == "feedback"):
        return "end_turn"
    return "force_quit" if steps_in_turn > max_steps_per_turn else "continue"


def hint_errors(step):
    """The error each φ_err hint is chosen by, per tool response of a step: per call its
    schema break if any (the call may have run), else its execution error; then the parse error."""
    errors = [s or e for s, e in zip(step["schema_errors"], step["call_errors"], strict=True)]
    return errors + ([step["parse_error"]] if step["parse_error"] else [])


class TrajectoryFailed(RuntimeError):
    """Handling one trajectory failed (engine request or environment); the stage must fail."""


def play(tasks, n, engine, spec, *, round_=0, policy="", progress=True):
    """Rollout records for `n` samples of every task played with `spec`, in (task, sample) order,
    and the wall time of the loop with the part spent inside the engine (and, when the engine
    counts them, the prompt tokens sent and those served from its prefix cache)."""
    if spec.schedule == "async" and not hasattr(engine, "submit"):
        raise ValueError(f"{type(engine).__name__} runs lock-step only (schedule 'async' needs vLLM servers)")
    kind = Rerendered if spec.rerender else Trajectory
    trajs = [kind(task, k, spec, engine.tokenizer, engine.stop_ids) for task in tasks for k in range(n)]
    start = time.perf_counter()
    before = {k: getattr(engine, k) for k in ("prompt_tokens", "cached_tokens") if hasattr(engine, k)}
    engine_seconds = run(trajs, engine, spec, progress)
    timing = {"seconds": time.perf_counter() - start, "engine_seconds": engine_seconds}
    timing.update({k: getattr(engine, k) - v for k, v in before.items()})
    sampling = sampling_params(spec.temperature)  # what the engine sampled with; the trainer needs T
    return [t.record(round_, policy) | {"sampling": sampling} for t in trajs], timing


def run(trajs, engine, spec, progress=True):
    """Play trajectories to their end with `spec.schedule`; returns the seconds spent inside the engine."""
    bar = tqdm(total=len(trajs), desc="trajectories", unit="traj", disable=not progress)
    try:
        return (_lockstep if spec.schedule == "lockstep" else _async)(trajs, engine, spec.temperature, bar)
    except BaseException:
        for t in trajs:
            if t.stop is None:
                t.env.close()  # free their environments' instances; the stage fails
        raise
    finally:
        bar.close()


def _room(t, bar):
    """The generation limit of a trajectory's next call, or None once it stopped on it."""
    limit = t.limit()
    if limit is None:
        bar.update(1)
    return limit


def _handle(t, gen, tok, bar):
    try:
        t.advance(gen, decode(tok, gen, t.stop_ids))
    except Exception as e:
        raise TrajectoryFailed(f"task {t.task['id']} sample {t.sample_index}: {type(e).__name__}: {e}") from e
    if t.stop is not None:
        bar.update(1)


def _speed(bar, generated, t0):
    bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - t0, 1e-9):.0f}")


def _lockstep(trajs, engine, temperature, bar):
    t0, engine_seconds, generated = time.perf_counter(), 0.0, 0
    while True:
        waiting = [(t, limit) for t in trajs if t.stop is None and (limit := _room(t, bar)) is not None]
        if not waiting:
            return engine_seconds
        t_gen = time.perf_counter()
        gens = engine.generate([t.context() for t, _ in waiting], [m for _, m in waiting], temperature)
        engine_seconds += time.perf_counter() - t_gen
        for (t, _), gen in zip(waiting, gens, strict=True):
            generated += len(gen.ids)
            _handle(t, gen, engine.tokenizer, bar)
        _speed(bar, generated, t0)


def _async(trajs, engine, temperature, bar):
    t0, engine_seconds, generated = time.perf_counter(), 0.0, 0

    def submit(i):
        """Submit trajectory i's next generation; returns the seconds it took (vLLM's own request
        processing: lock-step's generate() counts it inside the engine too)."""
        t = trajs[i]
        if (limit := _room(t, bar)) is None:
            return 0.0
        t_gen = time.perf_counter()
        try:
            engine.submit(i, t.context(), limit, temperature)
        except Exception as e:
            raise TrajectoryFailed(f"task {t.task['id']} sample {t.sample_index}: "
                                   f"engine request failed: {type(e).__name__}: {e}") from e
        return time.perf_counter() - t_gen

    try:
        engine_seconds += sum(submit(i) for i in range(len(trajs)))
        while engine.pending:
            t_gen = time.perf_counter()
            done = engine.poll()
            engine_seconds += time.perf_counter() - t_gen
            for i, gen in done:
                generated += len(gen.ids)
                _handle(trajs[i], gen, engine.tokenizer, bar)
                if trajs[i].stop is None:
                    engine_seconds += submit(i)  # straight back into the running batch
                if trajs[i].stop is not None and hasattr(engine, "release"):
                    engine.release(i)  # its server may take a new trajectory
            if done:
                _speed(bar, generated, t0)
    except BaseException:
        engine.abort()  # no request of a failed stage keeps running in the engine
        raise
    return engine_seconds


def decode(tok, gen, stop_ids):
    """The model's text as bfcl-eval's vLLM server returns it: without the stop id it ended on,
    special tokens skipped (tool-call tags are ordinary added tokens, and stay)."""
    ids = gen.ids[:-1] if gen.finish == "stop" and gen.ids and gen.ids[-1] in stop_ids else gen.ids
    return tok.decode(ids, skip_special_tokens=True)


def summary(records):
    """Counts people look at after a rollout: steps per turn, stop reasons, parse errors, tokens."""
    steps = [len(turn["steps"]) for r in records for turn in r["turns"]]
    all_steps = [s for r in records for turn in r["turns"] for s in turn["steps"]]
    stops = collections.Counter(r["stop"] for r in records)
    return {
        "trajectories": len(records),
        "mean_steps_per_turn": round(sum(steps) / max(len(steps), 1), 3),
        "stop_reasons": dict(sorted(stops.items())),
        "turn_ends": dict(sorted(collections.Counter(str(turn["end"]) for r in records for turn in r["turns"]).items())),
        "parse_error_rate": round(sum(s["parse_error"] is not None for s in all_steps) / max(len(all_steps), 1), 4),
        "call_error_rate": round(sum(e is not None for s in all_steps for e in s["call_errors"])
                                 / max(sum(len(s["call_errors"]) for s in all_steps), 1), 4),
        "gen_tokens": sum(r["stats"]["gen_tokens"] for r in records),
        "cue_tokens": sum(r["stats"]["cue_tokens"] for r in records),
        "context_tokens": sum(len(s["prompt_ids"]) + len(s["ids"]) for r in records
                              for s in [r["tokens"], *r["tokens"].get("segments", [])]),
    }


def cache_summary(timing):
    """The prefix cache's share of the prompt tokens the engine was sent (None: not counted)."""
    if "prompt_tokens" not in timing:
        return {}
    return {"prompt_tokens": timing["prompt_tokens"], "cached_tokens": timing["cached_tokens"],
            "cached_share": round(timing["cached_tokens"] / max(timing["prompt_tokens"], 1), 4)}
