"""τ²'s warm start of the tiny model (common/run/tiny.py, loop.sh tiny --set ENV=tau2:DOMAIN): the oracle's
episodes of the domain's first Tau2Env.TINY_TASKS train tasks against the scripted ScenarioUser, rendered by the
rollouts' own token-in/token-out policy, in both views of the tools. A task whose gold actions write something
is also learnt with a near miss (its last write's last string argument suffixed "_old": τ²'s tool refuses it,
its evaluator gives 0); a reading task that must tell the user something, with a closing message without it.
Its BPE learns the domain's policy, tool schemas and those episodes.
"""

import json

from common.envs.tau2 import Tau2Env
from common.run.tiny import CHAT_TEMPLATE, ScriptEngine, _log, near_miss, token_examples

# airline's five-call task was solved in 0 of 16 samples at temperature 1.0 after 180 steps, 5 of 16 after 300
STEPS = 300


class WarmStart:
    """The tiny build's data on ENV=tau2:DOMAIN (`args`: the build's)."""

    steps = STEPS

    def __init__(self, setting, args):
        self.setting, self.args = setting, args
        self.scripts = tau2_scripts(setting, args["miss_share"] > 0)
        self.info = {"tasks": f"{setting}:train", "preset_tasks": None}

    def key(self):
        return tau2_fingerprint(self.setting)

    def texts(self):
        return tau2_texts(self.scripts)

    def examples(self, tok, bpe):
        return tau2_examples(self.scripts, tok, self.args["context"], self.args["miss_share"])


def tau2_scripts(env_name, with_misses):
    """[(τ² task, make_script)] for the tiny τ² tasks: `make_script(miss)` is a fresh OracleScript,
    or with `miss` its near miss (None where the task writes nothing with a string argument)."""
    from common import envs
    from common.envs.tau2 import tau2
    from common.jsonl import RecordError

    env = envs.load(f"{env_name}:train", user="scripted")
    toolkit = env.tau2.registry.get_env_constructor(env.domain)().tools
    if not env.tasks:
        raise RecordError(f"{env_name}:train has no task a scripted episode can start")
    out = []
    for task in [t["tau2"] for t in env.tasks.values()][:Tau2Env.TINY_TASKS]:
        def make(miss, task=task):
            script = tau2.OracleScript(task, "json", shared=False)
            if not miss:
                return script
            writes = [i for i, a in enumerate(script.actions) if a.requestor == "assistant"
                      and toolkit.has_tool(a.name) and toolkit.tool_type(a.name).value == "write"
                      and any(isinstance(v, str) for v in a.arguments.values())]
            if not with_misses or not (writes or script.info):
                return None
            if not writes:  # a reading task scored on what it tells the user: the closing message omits it
                script.info = []
                return script
            a = script.actions[writes[-1]]
            call = near_miss([{"name": a.name, "arguments": a.arguments}])[0]
            script.actions[writes[-1]] = a.model_copy(update={"arguments": call["arguments"]})
            return script
        out.append((env, task, make))
    return out


def tau2_play(env, task, script, engine=None, omega=None, evaluate=True):
    """One scripted episode against the ScenarioUser: τ²'s result row (with `evaluate`, its reward)
    and the agent's policy (the script's text function, or with `engine` the rollouts' ModelPolicy
    writing through it)."""
    from common.engine.episode import PlaySpec
    from common.envs.tau2 import tau2

    made = []

    def players(task, tools, user_tools, system, fmt):
        policy = tau2.ModelPolicy(engine, tools, system, PlaySpec(omega=omega)) if engine else script.agent_text
        made.append(policy)
        return policy, env.tau2.classes[4](task)
    row = env.tau2.play(env.domain, task, players, env.max_steps, "json", evaluate=evaluate)
    return row, made[0]


def tau2_fingerprint(env_name):
    """What a τ² build learns from: its tasks, the domain's policy, tool schemas and database hash."""
    from common import envs

    env = envs.load(f"{env_name}:train", user="scripted")
    domain = env.tau2.registry.get_env_constructor(env.domain)()
    tasks = [t["tau2"].model_dump(mode="json") for t in env.tasks.values()][:Tau2Env.TINY_TASKS]
    return json.dumps([tasks, domain.get_policy(), env.tau2.schemas(env.domain), domain.get_db_hash()],
                      sort_keys=True, default=str).encode()


def tau2_texts(scripts):
    """The BPE's training text: the domain's policy and tool schemas, the scripted episodes' messages.
    Each episode is played once here and τ²'s reward of it logged (right 1, near misses 0)."""
    env = scripts[0][0]
    texts = [CHAT_TEMPLATE, env.tau2.registry.get_env_constructor(env.domain)().get_policy(),
             *(json.dumps(s) for s in env.tau2.schemas(env.domain))]
    rewards = {False: [], True: []}
    for env, task, make in scripts:
        for miss in (False, True):
            script = make(miss)
            if script is None:
                continue
            row, _ = tau2_play(env, task, script)
            rewards[miss].append(row["reward"])
            for m in row["transcript"]:
                texts.append(m.get("content") or "")
                texts += [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in m.get("tool_calls") or []]
    _log(f"{env.source}: τ²'s reward of the scripted episodes: {sum(rewards[False]):.0f}/{len(rewards[False])} "
         f"right, {sum(rewards[True]):.0f}/{len(rewards[True])} near misses")
    return [t for t in texts if t]


def tau2_examples(scripts, tok, context, share):
    """(examples, weights): every agent message of the scripted episodes, in both views of the tools
    (plain, and with Ω_0's schema cue), cut from the rollout's own tokens."""
    from common.seal import interface as omega_api

    examples, weights = [], []
    for omega in (None, omega_api.initial()):
        for env, task, make in scripts:
            miss = make(True)
            for script, w in ((make(False), 1.0 - share if miss else 1.0), (miss, share)):
                if script is None or w <= 0:
                    continue
                _, policy = tau2_play(env, task, script, ScriptEngine(tok, lambda script=script: script.agent_text(None, None)), omega, evaluate=False)
                made = token_examples(policy.log.prompt_ids, policy.log.ids, policy.log.mask, context)
                examples += made
                weights += [w] * len(made)
    return examples, weights

