"""The tiny model's warm start on ENV=mcp:DIR (common/run/tiny.py, loop.sh tiny --set ENV=mcp:DIR): the oracle's
episodes of DIR's first MCP.TINY_TASKS train tasks, played on the server and rendered by the rollouts' own
token-in/token-out engine, in both views of the tools (plain, Ω_0's schema cue); and, `miss_share` of the
time, a near miss: the last turn whose calls have a string argument with it suffixed "_old" (or, where no
call has one, the closing answers without their facts), which the checker scores 0, so GRPO's groups mix.
"""

import json

from common.run.tiny import CHAT_TEMPLATE, ScriptEngine, _log, near_miss, token_examples

STEPS = 300  # as τ²'s build: episodes of several turns and calls


class WarmStart:
    """The tiny build's data on ENV=mcp:DIR (`args`: the build's)."""

    steps = STEPS

    def __init__(self, setting, args):
        from common import envs
        from common.envs.mcp import MCP
        self.args, self.env = args, envs.load(f"{setting}:train")
        self.tasks = list(self.env.tasks.values())[:MCP.TINY_TASKS]
        self.info = {"tasks": f"{setting}:train", "preset_tasks": None}

    def key(self):
        """What the build learns from: the server's tools, its system prompt and the tasks."""
        return json.dumps([self.env.tools, self.env.spec["system"], self.tasks], sort_keys=True).encode()

    def scripts(self, task, miss):
        """Per turn, the outputs of the oracle (or its near miss: None where the task has none)."""
        from common.envs.mcp import verdict
        if not miss:
            return verdict.oracle_texts(task, "json")
        gold = list(task["gold"])
        k = next((k for k in reversed(range(len(gold))) if gold[k] and near_miss(gold[k])), None)
        if k is not None:
            gold[k] = near_miss(gold[k])
            return verdict.oracle_texts(task, "json", gold)
        return verdict.oracle_texts(task, "json", facts=False) if any(task["response"]) else None

    def texts(self):
        """The BPE's training text: the template, system prompt, tool schemas and the episodes' text."""
        texts = [CHAT_TEMPLATE, self.env.spec["system"] or "", *(json.dumps(t) for t in self.env.tools)]
        for task in self.tasks:
            texts += task["turns"] + [r for turn in self.env.gold[task["id"]] for r in turn["results"]]
            texts += [t for miss in (False, True) for turn in self.scripts(task, miss) or [] for t in turn]
        return [t for t in texts if t]

    def examples(self, tok, bpe):
        """(examples, weights): every output of the scripted episodes, cut from the rollout's own tokens; the
        plain view's episodes are diagnosed, and their rewards logged (the oracle's 1, the near misses' 0)."""
        from common.engine.episode import PlaySpec
        from common.seal import interface as omega_api

        share, examples, weights, rewards = self.args["miss_share"], [], [], {False: [], True: []}
        for omega in (None, omega_api.initial()):
            spec = PlaySpec(omega=omega, prompts="template", temperature=0.0, max_model_len=32768)
            for task in self.tasks:
                miss = self.scripts(task, True) if share > 0 else None
                for script, w, is_miss in ((self.scripts(task, False), 1.0 - share if miss else 1.0, False),
                                           (miss, share, True)):
                    if script is None or w <= 0:
                        continue
                    texts = iter(t for turn in script for t in turn)
                    (record,), _ = self.env.play([task], 1, ScriptEngine(tok, lambda texts=texts: next(texts)), spec)
                    if omega is None:
                        rewards[is_miss].append(self.env.diagnose(task, record)["reward"])
                    t = record["tokens"]
                    made = token_examples(t["prompt_ids"], t["ids"], t["mask"], self.args["context"])
                    examples += made
                    weights += [w] * len(made)
        _log(f"{self.env.source}: the checker's reward of the scripted episodes: {sum(rewards[False])}/"
             f"{len(rewards[False])} right, {sum(rewards[True])}/{len(rewards[True])} near misses")
        return examples, weights
