"""τ²'s warm start of the tiny model (common/run/tiny.py; docs/environments.md §2): the oracle's episodes
of the domain's first Tau2Env.TINY_TASKS train tasks against the ScenarioUser, rendered by the rollouts' own
policy in both views of the tools, and their near misses. Its BPE learns the domain's policy, tool schemas
and episodes.
"""

import json

from common.envs.tau2 import Tau2Env
from common.run.tiny import CHAT_TEMPLATE, ScriptEngine, _log, near_miss, token_examples


class WarmStart:
    """The tiny build's data on ENV=tau2:DOMAIN (`args`: the build's)."""

    # airline's five-call task was solved in 0/16 samples at temperature 1.0 after 180 steps, 5/16 after 300
    steps = 300

    def __init__(self, setting, args):
        from common import envs
        from common.jsonl import RecordError
        self.args, self.info = args, {"tasks": f"{setting}:train", "preset_tasks": None}
        self.env = envs.load(f"{setting}:train", user="scripted")
        if not self.env.tasks:
            raise RecordError(f"{setting}:train has no task a scripted episode can start")
        self.tasks = [t["tau2"] for t in self.env.tasks.values()][:Tau2Env.TINY_TASKS]
        self.domain = self.env.tau2.registry.get_env_constructor(self.env.domain)()  # never played on

    def key(self):
        """What the build learns from: its tasks, the domain's policy, tool schemas and database hash."""
        tasks = [task.model_dump(mode="json") for task in self.tasks]
        return json.dumps([tasks, self.domain.get_policy(), self.env.tau2.schemas(self.env.domain),
                           self.domain.get_db_hash()], sort_keys=True, default=str).encode()

    def script(self, task, miss):
        """A fresh OracleScript of `task` (the agent's own), or with `miss` its near miss (None where the
        build learns none, or the task neither writes with a string argument nor must tell anything)."""
        from common.envs.tau2 import tau2
        script, toolkit = tau2.OracleScript(task, "json", shared=False), self.domain.tools
        if not miss:
            return script
        writes = [i for i, a in enumerate(script.actions) if a.requestor == "assistant"
                  and toolkit.has_tool(a.name) and toolkit.tool_type(a.name).value == "write"
                  and any(isinstance(v, str) for v in a.arguments.values())]
        if self.args["miss_share"] <= 0 or not (writes or script.info):
            return None
        if not writes:  # a reading task scored on what it tells the user: the closing message omits it
            script.info = []
            return script
        a = script.actions[writes[-1]]
        call = near_miss([{"name": a.name, "arguments": a.arguments}])[0]
        script.actions[writes[-1]] = a.model_copy(update={"arguments": call["arguments"]})
        return script

    def texts(self):
        """The BPE's training text: the domain's policy and tool schemas, the scripted episodes' messages.
        Each episode is played once here and τ²'s reward of it logged (right 1, near misses 0)."""
        texts = [CHAT_TEMPLATE, self.domain.get_policy(),
                 *(json.dumps(s) for s in self.env.tau2.schemas(self.env.domain))]
        rewards = {False: [], True: []}
        for task in self.tasks:
            for miss in (False, True):
                script = self.script(task, miss)
                if script is None:
                    continue
                row, _ = tau2_play(self.env, task, script)
                rewards[miss].append(row["reward"])
                for m in row["transcript"]:
                    texts.append(m.get("content") or "")
                    texts += [json.dumps({"name": c["name"], "arguments": c["arguments"]})
                              for c in m.get("tool_calls") or []]
        right, misses = rewards[False], rewards[True]
        _log(f"{self.env.source}: τ²'s reward of the scripted episodes: {sum(right):.0f}/{len(right)} right, "
             f"{sum(misses):.0f}/{len(misses)} near misses")
        return [t for t in texts if t]

    def examples(self, tok, bpe):
        """(examples, weights): every agent message of the scripted episodes, in both views of the tools
        (plain, and with Ω_0's schema cue), cut from the rollout's own tokens."""
        from common.seal import interface as omega_api
        share, examples, weights = self.args["miss_share"], [], []
        for omega in (None, omega_api.initial()):
            for task in self.tasks:
                miss = self.script(task, True)
                for script, w in ((self.script(task, False), 1.0 - share if miss else 1.0), (miss, share)):
                    if script is None or w <= 0:
                        continue
                    engine = ScriptEngine(tok, lambda script=script: script.agent_text(None, None))
                    log = tau2_play(self.env, task, script, engine, omega, evaluate=False)[1].log
                    made = token_examples(log.prompt_ids, log.ids, log.mask, self.args["context"])
                    examples += made
                    weights += [w] * len(made)
        return examples, weights


def tau2_play(env, task, script, engine=None, omega=None, evaluate=True):
    """One scripted episode against the ScenarioUser: τ²'s result row (with `evaluate`, its reward)
    and the agent's policy (the script's text function, or with `engine` the rollouts' ModelPolicy)."""
    from common.engine.episode import PlaySpec
    from common.envs.tau2 import tau2
    made = []

    def players(task, tools, user_tools, system, fmt):
        policy = tau2.ModelPolicy(engine, tools, system, PlaySpec(omega=omega)) if engine else script.agent_text
        made.append(policy)
        return policy, env.tau2.classes[4](task)
    row = env.tau2.play(env.domain, task, players, env.max_steps, "json", evaluate=evaluate)
    return row, made[0]
