"""The episode engine: token-in/token-out episodes of any environment, played on a policy engine.

    records, timing = play(tasks, n, engine, spec, session, trajectory=Trajectory, round_=t, policy=model_dir)

A scripted-turn environment (BFCL, MCP) opens a session per episode, `session(task)`, that answers the
model's outputs (common/engine/session.py says what it answers). An environment whose own loop drives the
episode (τ²'s orchestrator) plays each in a thread (run_episodes), its policy keeping its tokens in a
TokenLog. docs/design.md §3.
"""

import collections
import contextlib
import dataclasses
import functools
import json
import queue
import threading
import time
import types
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from tqdm import tqdm

from common import presets
from common.engine.chat import Renderer, after_stop, kept_output, tool_messages
from common.engine.engines import sampling_params
from common.seal import interface as omega_api

# The call format each model family's prompts ask for, by the bfcl-eval handler that builds them.
CALL_FORMATS = {"QwenFCHandler": "json", "LlamaHandler": "python"}


class HandlerError(ValueError):
    """A handler name this project does not drive, or a call format that contradicts it."""


def call_format(handler, fmt=""):
    """How `handler`'s prompts ask the model to write calls; `fmt` given besides must be that one (any other
    would mis-decode every output, with no error)."""
    if handler not in CALL_FORMATS:
        raise HandlerError(f"unknown bfcl-eval handler {handler!r}; choices: {', '.join(CALL_FORMATS)}")
    own = CALL_FORMATS[handler]
    if fmt and fmt != own:
        raise HandlerError(f"call format {fmt} contradicts {handler}, whose prompts ask for {own} calls "
                           f"(leave the call format unset: it follows the handler)")
    return own


@dataclasses.dataclass(frozen=True)
class PlaySpec:
    """How every episode of a play is played (common/engine/playargs.py builds it from a stage's flags; the
    defaults are the presets'). omega: Ω or None; fmt: json or python calls (empty: the handler's);
    temperature: a temperature or a dict of SAMPLING_KEYS; max_steps_per_turn: a turn's step with calls past
    it force-quits; schedule: "lockstep" or "async" (vLLM); prompts: "bfcl" (bfcl-eval's `handler`) or
    "template" (the model's chat template); rerender: every prompt re-rendered whole, as bfcl-eval's harness."""

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


class TrajectoryFailed(RuntimeError):
    """Handling one trajectory failed (engine request or environment); the stage must fail."""


def decode(tok, gen, stop_ids):
    """The model's text as a vLLM server returns it: without the stop id it ended on, special tokens skipped
    (tool-call tags are ordinary added tokens, and stay)."""
    ids = gen.ids[:-1] if gen.finish == "stop" and gen.ids and gen.ids[-1] in stop_ids else gen.ids
    return tok.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- the token log


class TokenLog:
    """What training reads of an episode: the opening prompt's ids, then every id after it with its mask (1:
    generated) and log-prob; a context re-rendered (a thinking model's template dropping its reasoning) starts
    a new segment at the turn it happened in. Also Ω's cue tokens: what the agent read beyond the plain text."""

    def __init__(self, tokenizer, stop_ids, spec):
        self.tok, self.stop_ids = tokenizer, set(stop_ids)
        self.max_model_len, self.max_new_tokens = spec.max_model_len, spec.max_new_tokens
        self.prompt_ids, self.ids, self.mask, self.logprobs = None, [], [], []
        self.segments, self.segment_turn, self.cue_tokens, self.stop_text = [], 0, 0, ""

    def open(self, prompt_ids, plain=None):
        """Start at `prompt_ids`; `plain()`, where Ω's cues are on, gives the prompt without them."""
        self.prompt_ids = prompt_ids
        if plain is not None:
            self.cue_tokens += max(0, len(prompt_ids) - len(plain()))

    def context(self):
        return self.prompt_ids + self.ids

    def __len__(self):
        return len(self.prompt_ids) + len(self.ids)

    def room(self):
        """The generation limit of the next call, or None where the context is full."""
        room = self.max_model_len - len(self)
        return min(self.max_new_tokens, room) if room > 0 else None

    def encode(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def append(self, ids, mask, logprobs=None):
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [None] * len(ids)

    def take(self, gen, closing):
        """Append a generation as the context keeps it (common/engine/chat.py kept_output)."""
        ids, logprobs, self.stop_text = kept_output(self.tok, gen, self.stop_ids, closing)
        self.append(ids, 1, logprobs)

    def follow(self, text):
        """The ids of `text`, what follows the last generation, less the stop text its ids kept."""
        return self.encode(after_stop(text, self.stop_text))

    def hinted(self, contents, errors, tools, omega, rules=()):
        """(contents, feedback): the tool responses with Ω's recovery hint after each whose error (`errors`, one
        per response or None) has one, counted as cue tokens; feedback: the hints, or None."""
        contents, hints = list(contents), []
        for i, err in enumerate(errors[:len(contents)]):
            hint = omega_api.error_hint(err, tools, omega, rules) if err else None
            if hint:
                contents[i] = f"{contents[i]}\n{hint}"
                hints.append(hint)
                self.cue_tokens += len(self.encode(hint))
        return contents, "\n".join(hints) or None

    def new_segment(self, prompt_ids, turn):
        self.segments.append(self.segment())
        self.prompt_ids, self.ids, self.mask, self.logprobs = prompt_ids, [], [], []
        self.segment_turn = turn

    def segment(self):
        seg = {"turn": self.segment_turn} if self.segment_turn else {}  # the first starts the episode
        return seg | {"prompt_ids": self.prompt_ids, "ids": self.ids, "mask": self.mask, "logprobs": self.logprobs}

    def tokens(self):
        """The record's tokens: the first segment, and the later ones under `segments`."""
        first, *more = self.segments + [self.segment()]
        return first | ({"segments": more} if more else {})


def record(task, sample_index, round_, policy, omega, turns, stop, decode_failure, tokens, cue_tokens, seconds):
    """A rollout record (docs/design.md §3); an environment adds its own fields after these."""
    segments = [tokens, *tokens.get("segments", [])]
    return {"task_id": task["id"], "category": task["category"], "sample_index": sample_index, "round": round_,
            "policy": policy, "interface_version": omega.get("version") if omega else None, "turns": turns,
            "stop": stop, "decode_failure": decode_failure, "tokens": tokens,
            "stats": {"gen_tokens": sum(sum(s["mask"]) for s in segments), "cue_tokens": cue_tokens,
                      "seconds": round(seconds, 3)}}


class TemplateView:
    """What the model is shown under its own chat template (common/engine/chat.py): the conversation kept as
    messages; `plain_system`: the system prompt without Ω's cues."""

    def __init__(self, tokenizer, tools, shown, system, plain_system=None):
        self.tok, self.tools, self.plain_system = tokenizer, tools, plain_system
        self.renderer, self.history, self.before, self._closing = Renderer(tokenizer, shown, system), [], None, None

    def add_user(self, turn, msgs):
        self.history += msgs

    def prompt_ids(self):
        return self.renderer.prompt(self.history)

    def plain_prompt_ids(self):
        return Renderer(self.tok, self.tools, self.plain_system).prompt(self.history)

    def closing(self):
        if self._closing is None:  # the same for every message of the conversation: rendered once
            self._closing = self.renderer.closing()
        return self._closing

    def add_output(self, text, prompt_tokens=0, output_tokens=0):
        self.before = list(self.history)
        self.history.append({"role": "assistant", "content": text})

    def add_results(self, contents, names=()):
        self.history += tool_messages(contents)

    def drops_reasoning(self):
        return False

    def continuation(self, text, results, names, turn_msgs):
        """The text after the model's output `text`: what came back and a new turn's messages; None where the
        template renders no extension of it (Qwen3's drops earlier reasoning at a new user message)."""
        new = (tool_messages(results) if results is not None else []) + (turn_msgs or [])
        try:
            return self.renderer.continuation_text(self.before, text, new)
        except ValueError:
            return None


# ----------------------------------------------------------------------------- scripted-turn trajectories


def turn_action(step, steps_in_turn, decode_failure, max_steps_per_turn):
    """What bfcl-eval's inference loop does after a step (the `steps_in_turn`-th of its turn): "end_turn" (no
    calls: an answer, or an undecodable output under the "end_turn" rule), "force_quit" (calls ran and the turn
    has had more than `max_steps_per_turn` steps: with 20, the 21st quits), else "continue" (the results, or
    under the "feedback" rule the parse error, go back to the model)."""
    if not step["calls"] and not (step["parse_error"] and decode_failure == "feedback"):
        return "end_turn"
    return "force_quit" if steps_in_turn > max_steps_per_turn else "continue"


def hint_errors(step):
    """The error each φ_err hint is chosen by, per tool response of a step: per call its schema break if any
    (the call may have run), else its execution error; then the parse error."""
    errors = [s or e for s, e in zip(step["schema_errors"], step["call_errors"], strict=True)]
    return errors + ([step["parse_error"]] if step["parse_error"] else [])


class Trajectory:
    """One sample of one task on a scripted-turn session, token-in/token-out under the model's chat template.
    A turn ends on an output without calls; past `max_steps_per_turn` steps the task is force-quit. With Ω's
    error feedback on, an undecodable output is answered with its parse error and hint (`decode_failure`
    "feedback", else "end_turn"). The session's `system` prompt comes before Ω's; its `fault` ends the episode
    (stop "server_error"). Environments subclass it for their own view of the conversation."""

    def __init__(self, task, sample_index, spec, tokenizer, stop_ids=(), session=None):
        self.task, self.sample_index, self.spec, self.omega = task, sample_index, spec, spec.omega
        self.tok, self.stop_ids, self.env = tokenizer, set(stop_ids), session
        self.decode_failure = "feedback" if self.omega and self.omega["error_feedback"] else "end_turn"
        self.start = time.perf_counter()
        self.log = TokenLog(tokenizer, stop_ids, spec)
        self.turns, self.stop, self.error = [], None, None  # error: the environment's, the entry failed whole
        self.env.start_turn(0)
        tools = self.env.tools
        shown, system = omega_api.tool_view(tools, self.omega), omega_api.system_cue(self.omega)
        self.view = self.make_view(tools, shown, system)
        self._user_turn(0)
        self.log.open(self.view.prompt_ids(), self.view.plain_prompt_ids if shown is not tools or system else None)

    def make_view(self, tools, shown, system):
        own = getattr(self.env, "system", None)
        if own:
            return TemplateView(self.tok, tools, shown, "\n\n".join(x for x in (own, system) if x), plain_system=own)
        return TemplateView(self.tok, tools, shown, system)

    def turn_messages(self, turn):
        """(the user messages of `turn` as shown, the same without Ω's cues)."""
        msgs = self.env.user_messages(turn)
        return msgs, msgs

    def hint_rules(self):
        return getattr(self.env, "hint_rules", ())

    def names(self, step, n):
        """What the view pairs each of the `n` tool responses with."""
        return [c["name"] for c in step["calls"]] + [""] * (n - len(step["calls"]))

    def _user_turn(self, turn):
        msgs, plain = self.turn_messages(turn)
        self.view.add_user(turn, msgs)
        if msgs is not plain:  # schema-cue annotations of the tools a turn announces are cue tokens too
            self.log.cue_tokens += max(0, len(self.log.encode(msgs[0]["content"]))
                                       - len(self.log.encode(plain[0]["content"])))
        self.turns.append({"steps": [], "end": None})
        return msgs

    def context(self):
        """The ids the engine gets for this trajectory's next output."""
        return self.log.context()

    def finish(self, stop, end=None):
        self.stop = stop
        if end and self.turns and self.turns[-1]["end"] is None:
            self.turns[-1]["end"] = end
        self.env.close()

    def fail(self, error):
        """The environment's error building the next prompt: recorded, and the entry is scored as failed."""
        self.error = error
        self.finish("inference_error", "inference_error")

    def limit(self):
        """The generation limit of the next call, or None once the trajectory stopped: on its environment's
        fault or a full context."""
        if getattr(self.env, "fault", None):
            return self.finish("server_error", "server_error")
        room = self.log.room()
        if room is None:
            self.finish("context_limit", "context_limit")
        return room

    def advance(self, gen, text):
        """Take one model output: run its calls and add what the model sees next."""
        self._take_output(gen, text)
        step = {"text": text, **self.env.step(text, self.spec.fmt), "feedback": None, **self._step_log(gen)}
        turn = self.turns[-1]
        turn["steps"].append(step)
        action = turn_action(step, len(turn["steps"]), self.decode_failure, self.spec.max_steps_per_turn)
        if action == "force_quit":
            return self.finish("step_limit", "step_limit")
        results, names, turn_msgs = None, (), None
        if action == "continue":
            contents = list(step["results"])
            # only the results of the calls decoded are shown (a skipped <tool_call> block goes unmentioned);
            # telling the model about it is Ω's error feedback
            if step["parse_error"] and self.decode_failure == "feedback":
                contents.append(f"Error: could not parse tool calls: {step['parse_error']}")
            results, step["feedback"] = self.log.hinted(contents, hint_errors(step), self.env.tools, self.omega,
                                                        self.hint_rules())
            names = self.names(step, len(results))
            self.view.add_results(results, names)
        else:
            turn["end"] = "decode_error" if step["parse_error"] else "answer"
            if len(self.turns) == self.env.n_turns:
                return self.finish("done")
            self.env.start_turn(len(self.turns))
            turn_msgs = self._user_turn(len(self.turns))
        return self._next(text, results, names, turn_msgs)

    def _take_output(self, gen, text):
        closing = self.view.closing()
        self.view.add_output(text, len(self.log), len(gen.ids))
        self.log.take(gen, closing)

    def _step_log(self, gen):
        return {}

    def _next(self, text, results, names, turn_msgs):
        """Append what the model sees after its output `text`, unless it does not fit."""
        more_text = None if turn_msgs is not None and self.view.drops_reasoning() else \
            self.view.continuation(text, results, names, turn_msgs)
        if more_text is None:
            return self._rerender()
        more = self.log.follow(more_text)
        if len(self.log) + len(more) >= self.spec.max_model_len:
            # what the model would see next does not fit (with room for one token)
            return self.finish("context_limit", "context_limit")
        self.log.append(more, 0)
        return None

    def _rerender(self):
        """Go on from the view's rendering of the whole history in a new segment, unless it cannot be built
        (an inference error) or fit."""
        try:
            prompt = self.view.prompt_ids()
        except Exception as e:
            return self.fail(str(e))
        if len(prompt) >= self.spec.max_model_len:
            return self.finish("context_limit", "context_limit")
        self.log.new_segment(prompt, len(self.turns) - 1)
        return None

    def record(self, round_, policy):
        rec = record(self.task, self.sample_index, round_, policy, self.omega, self.turns, self.stop,
                     self.decode_failure, self.log.tokens(), self.log.cue_tokens, time.perf_counter() - self.start)
        fault = getattr(self.env, "fault", None)
        return rec | ({"inference_error": self.error} if self.error is not None else {}) | \
            ({"error": fault} if fault else {})


# ----------------------------------------------------------------------------- playing them


def timed(engine, spec, run):
    """(records, timing) of `run()` -> (records, seconds inside the engine): the wall time, the engine's part
    and, where the engine counts them, the prompt tokens sent and those its prefix cache served; each record
    says what the engine sampled with (the trainer needs the temperature)."""
    start = time.perf_counter()
    before = {k: getattr(engine, k) for k in ("prompt_tokens", "cached_tokens") if hasattr(engine, k)}
    records, engine_seconds = run()
    timing = {"seconds": time.perf_counter() - start, "engine_seconds": engine_seconds}
    timing.update({k: getattr(engine, k) - v for k, v in before.items()})
    sampling = sampling_params(spec.temperature)
    return [r | {"sampling": sampling} for r in records], timing


def play(tasks, n, engine, spec, session, *, trajectory=Trajectory, round_=0, policy="", progress=True):
    """Rollout records of `n` samples of every task in (task, sample) order, each the `trajectory` (class or
    factory) of a session `session(task)` opens, played with `spec`; and the timing (timed)."""
    if spec.schedule == "async" and not hasattr(engine, "submit"):
        raise ValueError(f"{type(engine).__name__} runs lock-step only (schedule 'async' needs vLLM servers)")
    trajs = [trajectory(task, k, spec, engine.tokenizer, engine.stop_ids, session(task))
             for task in tasks for k in range(n)]

    def run_all():
        engine_seconds = run(trajs, engine, spec, progress)
        return [t.record(round_, policy) for t in trajs], engine_seconds
    return timed(engine, spec, run_all)


def run(trajs, engine, spec, progress=True):
    """Play trajectories to their end on `spec.schedule`; returns the seconds spent inside the engine."""
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
    """All trajectories waiting for the model advance together, one batched engine call per step."""
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
    """Each trajectory's next generation is submitted as soon as its last is handled (vLLM's submit/poll:
    continuous batching keeps the batch full); a failure aborts the engine's queued requests."""
    t0, engine_seconds, generated = time.perf_counter(), 0.0, 0

    def submit(i):  # the seconds it took (vLLM's own request processing, as lock-step counts it)
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


# ----------------------------------------------------------------------------- episodes in threads


class Batcher:
    """The engine for episodes in threads on the lock-step schedule: one thread owns it, and the prompts the
    episodes have handed in by the time it is free go to the engine as one batch."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.stop_ids, self.queue = engine, engine.tokenizer, engine.stop_ids, queue.Queue()
        self.lock, self.closed, self.engine_seconds = threading.Lock(), False, 0.0
        self.thread = threading.Thread(target=self._run, name="episode-engine", daemon=True)
        self.thread.start()

    def generate(self, prompts, max_new_tokens, temperature):
        futures = []
        with self.lock:
            if self.closed:
                raise RuntimeError("the engine is closed")
            for p, m in zip(prompts, max_new_tokens, strict=True):
                futures.append(Future())
                self.queue.put((p, m, temperature, futures[-1]))
        return [f.result() for f in futures]

    def _run(self):
        while (item := self.queue.get()) is not None:
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while (more := self.queue.get_nowait()) is not None:
                    batch.append(more)
                self.queue.put(None)  # the stop marker came with this batch: stop after it
            by_sampling = {}  # a temperature, or a dict of sampling settings
            for job in batch:
                by_sampling.setdefault(json.dumps(job[2], sort_keys=True), []).append(job)
            for jobs in by_sampling.values():
                try:
                    t0 = time.perf_counter()
                    gens = self.engine.generate([j[0] for j in jobs], [j[1] for j in jobs], jobs[0][2])
                    self.engine_seconds += time.perf_counter() - t0
                except BaseException as e:  # noqa: BLE001 - handed to the waiting episodes
                    for j in jobs:
                        j[3].set_exception(e)
                    continue
                for j, gen in zip(jobs, gens, strict=True):
                    j[3].set_result(gen)

    def play(self, key, job, one):
        return one(job, self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.closed = True
            self.queue.put(None)
        self.thread.join()
        with contextlib.suppress(queue.Empty):
            while True:  # requests that came with or after the stop marker
                if (job := self.queue.get_nowait()) is not None:
                    job[3].set_exception(RuntimeError("the engine is closed"))


class Requests:
    """The engine for episodes in threads on the async schedule (vLLM servers): each episode sends its own
    generations as soon as it needs them (ServerEngine.request under its key: one server and its prefix
    cache, per-request seeds), with no barrier across episodes. `engine_seconds`: the wall time during which
    some request was in flight. Closed, it refuses new requests."""

    def __init__(self, engine):
        self.engine, self.lock, self.closed = engine, threading.Lock(), False
        self.in_flight, self.since, self.engine_seconds = 0, 0.0, 0.0

    def play(self, key, job, one):
        """`one(job, agent)`, `agent` the episode's own engine (`key`'s), released when it ends."""
        agent = types.SimpleNamespace(tokenizer=self.engine.tokenizer, stop_ids=self.engine.stop_ids,
                                      generate=functools.partial(self.generate, key))
        try:
            return one(job, agent)
        finally:
            self.engine.release(key)

    def generate(self, key, prompts, max_new_tokens, sampling):
        if len(prompts) != 1:
            raise ValueError(f"an episode generates one prompt at a time, not {len(prompts)}")
        with self.lock:
            if self.closed:
                raise RuntimeError("the engine is closed")
            if not self.in_flight:
                self.since = time.perf_counter()
            self.in_flight += 1
        try:
            return [self.engine.request(key, prompts[0], max_new_tokens[0], sampling)]
        finally:
            with self.lock:
                self.in_flight -= 1
                if not self.in_flight:
                    self.engine_seconds += time.perf_counter() - self.since

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.closed = True


# Episodes at once by default: lock-step, the Batcher's largest batch; async, as many as the engine keeps in
# flight up to EPISODES (each holds its own environment: τ²'s airline database is ~27 MB).
BATCH, EPISODES = 16, 64


def run_episodes(jobs, one, engine, schedule, concurrency=None):
    """(results in job order, seconds the engine was busy): `one(job, agent)` for every (key, job) of `jobs`,
    `agent` the episode's engine, each episode in its own thread (an environment's blocking loop drives it),
    `concurrency` at once. "async" (vLLM servers, Requests): an episode sends its next generation as soon as
    it needs it, under its key; "lockstep": the prompts the episodes wait on go to the engine as one batch
    (Batcher). `engine` None: no engine (a scripted agent).
    The first episode that raises fails the whole: no other starts, those running stop at their next call."""
    if engine is not None and schedule == "async" and not hasattr(engine, "request"):
        raise ValueError(f"{type(engine).__name__} runs lock-step only (schedule 'async' needs vLLM servers)")
    if concurrency is None:
        concurrency = 1 if engine is None else BATCH if schedule == "lockstep" else min(EPISODES, engine.max_in_flight)
    concurrency = max(1, min(concurrency, len(jobs)))
    if engine is None:
        return [one(job, None) for _, job in jobs], 0.0
    shared = Requests(engine) if schedule == "async" else Batcher(engine)
    with shared:
        pool = ThreadPoolExecutor(concurrency, thread_name_prefix="episode")
        try:
            futures = [pool.submit(shared.play, key, job, one) for key, job in jobs]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            results = [f.result() for f in futures]
        finally:  # on an error or Ctrl-C, start no more episodes; running ones fail at their next call
            pool.shutdown(wait=False, cancel_futures=True)
    return results, shared.engine_seconds


# ----------------------------------------------------------------------------- what people look at


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
    """The prefix cache's share of the prompt tokens the engine was sent (empty: not counted)."""
    if "prompt_tokens" not in timing:
        return {}
    return {"prompt_tokens": timing["prompt_tokens"], "cached_tokens": timing["cached_tokens"],
            "cached_share": round(timing["cached_tokens"] / max(timing["prompt_tokens"], 1), 4)}
