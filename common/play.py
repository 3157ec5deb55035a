"""The multi-turn BFCL protocol, played by a policy engine for many trajectories at once.

For each user turn the model answers; parsed calls are executed as bfcl-eval's
harness executes them (common/bfcl.py) and their results fed back as tool
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
TrajectoryFailed naming the task and sample. rollout.py and evaluate.py are thin
command lines around `play`.
"""

import collections
import contextlib
import os
import time

from tqdm import tqdm

from common import bfcl, serve
from common import interface as omega_api
from common.chat import Renderer, after_stop, kept_output, tool_messages
from common.engines import sampling_params
from common.jsonl import RecordError
from common.prompts import Conversation, PromptIds, announced, first_prompt


class Trajectory:
    """One sample of one task: its environment, what the model is shown, and the record.

    `prompts` "bfcl" shows the model what bfcl-eval's handler `handler` builds
    (common/prompts.py); "template" renders with the model's own chat template
    (`tools=`, verl's convention; common/chat.py). With `rerender` (evaluation,
    "bfcl" only) every prompt is the handler's rendering of the whole history, as
    bfcl-eval's harness sends it; otherwise the generated ids stay in the context
    (token-in/token-out) and only what follows them is rendered.
    """

    def __init__(self, task, sample_index, omega, tokenizer, fmt, prompts="bfcl", handler="QwenFCHandler",
                 rerender=False, stop_ids=()):
        if prompts not in ("bfcl", "template"):
            raise ValueError(f"unknown prompt format {prompts!r} (bfcl or template)")
        if rerender and prompts != "bfcl":
            raise ValueError("re-rendered prompts are bfcl-eval's (prompts='bfcl')")
        self.task, self.sample_index, self.omega, self.fmt = task, sample_index, omega, fmt
        self.tok, self.rerender, self.stop_ids = tokenizer, rerender, set(stop_ids)
        self.decode_failure = "feedback" if omega and omega["error_feedback"] else "end_turn"
        self.env = bfcl.Environment(task)
        self.start = time.perf_counter()
        self.cue_tokens = 0
        self.turns = []
        self.stop = None
        self.error = None  # bfcl-eval's inference error: the entry failed as a whole
        self.closing = None  # how the format closes an assistant message (token-in/token-out)
        tools = bfcl.tools_at(task, 0)
        shown, system = omega_api.tool_view(tools, omega), omega_api.system_cue(omega)
        self.ids, self.mask, self.logprobs = [], [], []
        self.step_prompts = []  # rerender: the prompt text of every step, for bfcl-eval's result files
        self.encoder = PromptIds(tokenizer)  # bfcl prompts: each prompt's ids, reusing the last prompt's
        if prompts == "template":
            self.conv, self.renderer, self.history = None, Renderer(tokenizer, shown, system), []
            self.prompt_ids = self.renderer.prompt(self._enter_turn(0))
            plain = lambda: Renderer(tokenizer, tools).prompt(self.history)  # noqa: E731
        else:
            self.conv, self.renderer = Conversation(handler, task, shown, system), None
            self._enter_turn(0)
            self.step_prompts.append(self.conv.prompt())
            self.prompt_ids = self._encode(self.step_prompts[0])
            def plain():  # encoded whole: not a prompt of this trajectory
                return self.tok(first_prompt(task, tools, handler_name=handler))["input_ids"]
        self.next_prompt = self.prompt_ids
        if shown is not tools or system:
            # Schema-cue annotations and capability cues: what the prompt has beyond the plain one.
            self.cue_tokens += max(0, len(self.prompt_ids) - len(plain()))

    def _encode(self, text):
        """Ids of a whole prompt, as vLLM's server tokenises a completion request's text."""
        return self.encoder(text)

    def _enter_turn(self, turn):
        """Start `turn` in the environment; returns its user messages (new tools announced)."""
        self.env.start_turn(turn)
        # bfcl-eval announces a held-out turn's tools (in the task's order) whatever came before
        revealed = announced(self.task, turn)
        is_announced = revealed is not None
        shown = omega_api.tool_view(revealed, self.omega) if is_announced else None
        if self.conv is None:
            msgs = bfcl.turn_messages(self.task, turn, new_tools=shown)
            plain = bfcl.turn_messages(self.task, turn) if is_announced else msgs
            self.history += msgs
        else:
            msgs = self.conv.turn_messages(turn, shown)
            plain = self.conv.turn_messages(turn, revealed if is_announced else None)
            self.conv.add_user(turn, msgs)
        if msgs is not plain:
            # Schema-cue annotations of revealed tools are cue tokens too.
            self.cue_tokens += max(0, len(self.tok(msgs[0]["content"], add_special_tokens=False)["input_ids"])
                                   - len(self.tok(plain[0]["content"], add_special_tokens=False)["input_ids"]))
        self.turns.append({"steps": [], "end": None})
        return msgs

    def context(self):
        """The ids the engine gets for this trajectory's next output."""
        return self.next_prompt if self.rerender else self.prompt_ids + self.ids

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

    def limit(self, max_model_len, max_new_tokens):
        """The generation limit of the next call, or None once the trajectory has stopped on it.

        Re-rendered (bfcl-eval's local inference): `min(max_new_tokens, ctx - input - 2)` with the
        input counted by `tokenizer.tokenize`; a prompt with no room fails the entry (its server
        rejects the request). Token-in/token-out: what is left of the context.
        """
        if self.rerender:
            n = len(self.next_prompt) - self.tok.num_special_tokens_to_add()  # = len(tokenize(prompt))
            if max_model_len < n + 2:
                self.fail(f"the prompt ({n} tokens) does not fit the model's context ({max_model_len})")
                return None
            return min(max_new_tokens, max_model_len - n - 2)
        room = max_model_len - self.context_len()
        if room > 0:
            return min(max_new_tokens, room)
        self.finish("context_limit", "context_limit")
        return None

    def advance(self, gen, text, max_steps_per_turn, max_model_len):
        """Take one model output: execute its calls and add what the model sees next."""
        stop_text = self._take_output(gen)
        # Only a re-rendered prompt reads the handler's history; token-in/token-out keeps the ids.
        parsed = self.conv.add_assistant(text, len(self.next_prompt), len(gen.ids)) if self.rerender else None
        step = {"text": text, **self.env.step(text, self.fmt), "feedback": None}
        if self.rerender:  # bfcl-eval's result files log these per step
            step.update(formatted_prompt=self.step_prompts[-1], prompt_tokens=len(self.next_prompt),
                        output_tokens=len(gen.ids))
        turn = self.turns[-1]
        turn["steps"].append(step)
        history = list(self.history) if self.conv is None else None
        if self.conv is None:
            self.history.append({"role": "assistant", "content": text})

        action = turn_action(step, len(turn["steps"]), self.decode_failure, max_steps_per_turn)
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
            if self.conv is None:
                self.history += tool_messages(contents)
            elif self.rerender:
                self.conv.add_results(contents, parsed, names)
        else:
            turn["end"] = "decode_error" if step["parse_error"] else "answer"
            if len(self.turns) == len(self.task["questions"]):
                return self.finish("done")
            turn_msgs = self._enter_turn(len(self.turns))

        if self.rerender:
            try:  # bfcl-eval renders the next prompt from what its handler kept; this can raise
                prompt = self.conv.prompt()
            except Exception as e:
                return self.fail(str(e))
            self.step_prompts.append(prompt)
            self.next_prompt = self._encode(prompt)
            return None
        if self.conv is None:
            new = (tool_messages(results) if results is not None else []) + (turn_msgs or [])
            more_text = self.renderer.continuation_text(history, text, new)
        else:
            more_text = self.conv.continuation(results, names, turn_msgs)
        more = self.tok(after_stop(more_text, stop_text), add_special_tokens=False)["input_ids"]
        if self.context_len() + len(more) >= max_model_len:
            # What the model would see next does not fit (with room for one token).
            return self.finish("context_limit", "context_limit")
        self._append(more, 0)
        return None

    def _take_output(self, gen):
        """Append the generated ids as the context keeps them; returns the stop text kept."""
        if self.rerender:  # the next prompt is rendered anew: the ids are only recorded
            self._append(list(gen.ids), 1, list(gen.logprobs))
            return ""
        if self.closing is None:  # the same for every message of the conversation: rendered once
            self.closing = self.renderer.closing() if self.conv is None else self.conv.continuation()
        ids, logprobs, stop_text = kept_output(self.tok, gen, self.stop_ids, self.closing)
        self._append(ids, 1, logprobs)
        return stop_text

    def record(self, round_, policy):
        rec = {
            "task_id": self.task["id"], "category": self.task["category"], "sample_index": self.sample_index,
            "round": round_, "policy": policy,
            "interface_version": self.omega.get("version") if self.omega else None,
            "turns": self.turns, "stop": self.stop, "decode_failure": self.decode_failure,
            "tokens": {"prompt_ids": self.prompt_ids, "ids": self.ids, "mask": self.mask, "logprobs": self.logprobs},
            "stats": {"gen_tokens": sum(self.mask), "cue_tokens": self.cue_tokens,
                      "seconds": round(time.perf_counter() - self.start, 3)},
        }
        if self.error is not None:
            rec["inference_error"] = self.error
        return rec


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


def add_play_args(parser, *, max_model_len, max_new_tokens):
    """The engine and play flags rollout.py and evaluate.py share, declared once so that their
    meaning cannot drift apart. The length defaults are the caller's: evaluation plays as
    bfcl-eval's local inference (the model's context, None here; 4096 new tokens), training
    within the preset's budget."""
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"],
                        help="vllm (vLLM servers, common/serve.py), or hf (transformers generate in this process, "
                             "lock-step only)")
    parser.add_argument("--handler", default="QwenFCHandler",
                        help="the bfcl-eval handler whose prompts the model is shown and whose call format is "
                             "the default (common/prompts.py HANDLERS)")
    parser.add_argument("--call-format", default=None, choices=["json", "python"],
                        help="how calls are decoded: json, Qwen <tool_call> blocks; python, [f(a=1)] lists "
                             "(ToolACE); default: the handler's")
    parser.add_argument("--max-steps-per-turn", type=int, default=20,
                        help="a turn's step with calls past this many force-quits the task (bfcl-eval: 20)")
    parser.add_argument("--max-model-len", type=int, default=max_model_len,
                        help="context in tokens (default: %(default)s)" if max_model_len is not None else
                        "context (default: the model's max_position_embeddings, as bfcl-eval's local inference)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                        help="cap on new tokens per model call (default: %(default)s; bfcl-eval: "
                             "min(4096, context - prompt - 2))")
    serve.add_server_args(parser)
    parser.add_argument("--schedule", default=None, choices=["async", "lockstep"],
                        help="per-trajectory (vLLM's default) or one batched call per step (HF's only)")


def schedule_for(engine_kind, schedule, error):
    """The schedule a stage runs: async by default on vLLM; HF generate runs lock-step only."""
    if engine_kind == "hf" and schedule == "async":
        error("--schedule async needs --engine vllm (the HF engine advances trajectories in lock-step)")
    return schedule or ("async" if engine_kind == "vllm" else "lockstep")


@contextlib.contextmanager
def open_engine(args, model, *, seed, log):
    """The stage's engine for `model`: vLLM servers (--server URL[,URL...], or one started here for
    the block's lifetime, logging to --server-log or `log`), or transformers generate in this
    process (--engine hf). Servers are checked to serve `model`'s weights before anything plays."""
    from common.engines import ServerEngine, make_engine  # imports torch: only for model policies

    if args.engine == "hf":
        if args.server or args.tensor_parallel_size != 1 or args.data_parallel_size != 1:
            raise RecordError("--engine hf runs in this process: no --server, tensor or data parallel size")
        engine = make_engine("hf", model, max_model_len=args.max_model_len, seed=seed)
        try:
            yield engine
        finally:
            engine.close()
        return
    with contextlib.ExitStack() as stack:
        if args.server:
            urls = serve.parse_servers(args.server)
            logs = {urls[0]: args.server_log} if args.server_log and len(urls) == 1 else {}
        else:
            log = args.server_log or log
            url = stack.enter_context(serve.serving(
                model, log, max_model_len=args.max_model_len, seed=seed, tensor_parallel_size=args.tensor_parallel_size,
                data_parallel_size=args.data_parallel_size,
                gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None)))
            urls, logs = [url], {url: log}
        engine = ServerEngine(urls, model, max_model_len=args.max_model_len, seed=seed, logs=logs)
        stack.callback(engine.close)
        yield engine


@contextlib.contextmanager
def greedy_player(args, error, log):
    """evaluate.py's model policy: yields run(tasks), which plays each task once as bfcl-eval's
    harness does (Ω removed, the handler's prompts re-rendered every step, bfcl-eval's decoding)
    within evaluate.py's engine and length arguments, and returns the records."""
    from common.models import model_sampling

    schedule = schedule_for(args.engine, args.schedule, error)
    # bfcl-eval asks its vLLM server for temperature 0.001; the server fills in the rest from the
    # model's generation_config.json (vLLM's default --generation-config auto).
    sampling = ({"temperature": 0.001, **model_sampling(args.policy)} if args.decoding == "bfcl" else 0.0)
    with open_engine(args, args.policy, seed=0, log=log) as engine:
        def run(tasks):
            return play(tasks, 1, engine, omega=None, fmt=args.call_format, temperature=sampling,
                        max_steps_per_turn=args.max_steps_per_turn, max_model_len=args.max_model_len,
                        max_new_tokens=args.max_new_tokens, policy=os.path.abspath(args.policy), schedule=schedule,
                        prompts="bfcl", handler=args.handler, rerender=True)[0]
        yield run


class TrajectoryFailed(RuntimeError):
    """Handling one trajectory failed (engine request or environment); the stage must fail."""


def play(tasks, n, engine, *, omega=None, fmt="json", temperature=1.0, max_steps_per_turn=20,
         max_model_len=16384, max_new_tokens=512, round_=0, policy="", progress=True, schedule="lockstep",
         prompts="bfcl", handler="QwenFCHandler", rerender=False):
    """Rollout records for `n` samples of every task, in (task, sample) order, and the wall
    time of the loop with the part spent inside the engine (and, when the engine counts
    them, the prompt tokens sent and those served from its prefix cache).

    `temperature` is what the engine samples with (a temperature, or a dict of
    common.engines.SAMPLING_KEYS); `prompts`, `handler` and `rerender` say what the model
    is shown (Trajectory)."""
    if schedule not in ("lockstep", "async"):
        raise ValueError(f"unknown schedule {schedule!r} (lockstep or async)")
    if schedule == "async" and not hasattr(engine, "submit"):
        raise ValueError(f"{type(engine).__name__} runs lock-step only (schedule 'async' needs vLLM servers)")
    tok = engine.tokenizer
    trajs = [Trajectory(task, k, omega, tok, fmt, prompts, handler, rerender, engine.stop_ids)
             for task in tasks for k in range(n)]
    bar = tqdm(total=len(trajs), desc="trajectories", unit="traj", disable=not progress)
    counts = {"start": time.perf_counter(), "engine_seconds": 0.0, "generated": 0}
    before = {k: getattr(engine, k) for k in ("prompt_tokens", "cached_tokens") if hasattr(engine, k)}
    step = _lockstep if schedule == "lockstep" else _async
    try:
        step(trajs, engine, counts, bar, temperature, max_steps_per_turn, max_model_len, max_new_tokens)
    except BaseException:
        for t in trajs:
            if t.stop is None:
                t.env.close()  # free their environments' instances; the stage fails
        raise
    finally:
        bar.close()
    timing = {"seconds": time.perf_counter() - counts["start"], "engine_seconds": counts["engine_seconds"]}
    timing.update({k: getattr(engine, k) - v for k, v in before.items()})
    sampling = sampling_params(temperature)  # what the engine sampled with; the trainer needs T
    return [t.record(round_, policy) | {"sampling": sampling} for t in trajs], timing


def _room(t, max_model_len, max_new_tokens, bar):
    """The generation limit of a trajectory's next call, or None once it stopped on it."""
    limit = t.limit(max_model_len, max_new_tokens)
    if limit is None:
        bar.update(1)
    return limit


def _handle(t, gen, tok, counts, bar, max_steps_per_turn, max_model_len):
    counts["generated"] += len(gen.ids)
    try:
        t.advance(gen, decode(tok, gen, t.stop_ids), max_steps_per_turn, max_model_len)
    except Exception as e:
        raise TrajectoryFailed(f"task {t.task['id']} sample {t.sample_index}: {type(e).__name__}: {e}") from e
    if t.stop is not None:
        bar.update(1)


def _lockstep(trajs, engine, counts, bar, temperature, max_steps_per_turn, max_model_len, max_new_tokens):
    t0 = counts["start"]
    while True:
        waiting = []
        for t in trajs:
            if t.stop is None and (limit := _room(t, max_model_len, max_new_tokens, bar)) is not None:
                waiting.append((t, limit))
        if not waiting:
            return
        t_gen = time.perf_counter()
        gens = engine.generate([t.context() for t, _ in waiting], [m for _, m in waiting], temperature)
        counts["engine_seconds"] += time.perf_counter() - t_gen
        for (t, _), gen in zip(waiting, gens, strict=True):
            _handle(t, gen, engine.tokenizer, counts, bar, max_steps_per_turn, max_model_len)
        bar.set_postfix(tok_s=f"{counts['generated'] / max(time.perf_counter() - t0, 1e-9):.0f}")


def _async(trajs, engine, counts, bar, temperature, max_steps_per_turn, max_model_len, max_new_tokens):
    t0 = counts["start"]

    def submit(i):
        t = trajs[i]
        if (limit := _room(t, max_model_len, max_new_tokens, bar)) is None:
            return
        t_gen = time.perf_counter()
        try:
            engine.submit(i, t.context(), limit, temperature)
        except Exception as e:
            raise TrajectoryFailed(f"task {t.task['id']} sample {t.sample_index}: "
                                   f"engine request failed: {type(e).__name__}: {e}") from e
        # vLLM's own request processing (lock-step's generate() counts it inside the engine too)
        counts["engine_seconds"] += time.perf_counter() - t_gen

    try:
        for i in range(len(trajs)):
            submit(i)
        while engine.pending:
            t_gen = time.perf_counter()
            done = engine.poll()
            counts["engine_seconds"] += time.perf_counter() - t_gen
            for i, gen in done:
                _handle(trajs[i], gen, engine.tokenizer, counts, bar, max_steps_per_turn, max_model_len)
                if trajs[i].stop is None:
                    submit(i)  # straight back into the running batch
                if trajs[i].stop is not None and hasattr(engine, "release"):
                    engine.release(i)  # its server may take a new trajectory
            if done:
                bar.set_postfix(tok_s=f"{counts['generated'] / max(time.perf_counter() - t0, 1e-9):.0f}")
    except BaseException:
        engine.abort()  # no request of a failed stage keeps running in the engine
        raise


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
        "context_tokens": sum(len(r["tokens"]["prompt_ids"]) + len(r["tokens"]["ids"]) for r in records),
    }


def cache_summary(timing):
    """The prefix cache's share of the prompt tokens the engine was sent (None: not counted)."""
    if "prompt_tokens" not in timing:
        return {}
    return {"prompt_tokens": timing["prompt_tokens"], "cached_tokens": timing["cached_tokens"],
            "cached_share": round(timing["cached_tokens"] / max(timing["prompt_tokens"], 1), 4)}
