"""How long τ² episodes are in tokens: the context a τ² preset's training (MAX_LEN) must hold.

    .venv/bin/python bench/tau2_context.py [--tokenizer DIR] [--domains airline retail telecom] [--limit K]

Plays the oracle's episode of every playable task of each domain's train and test splits (the gold
actions in order against the scripted ScenarioUser, common/envs/tau2/tau2.py) through the rollouts' own
token-in/token-out policy (ModelPolicy, with Ω_0's cues, as a round-0 rollout) and prints per
domain: the opening prompt (system prompt, domain policy, tool schemas, the user's first message),
and the longest context any step of an episode reached (median, 90th percentile, max). The
rendering is the tiny model's chat template (Qwen2.5's tool format); the tokens are those of
`--tokenizer` (default: the tiny build's; a Qwen2.5 or Qwen3 tokenizer folder gives the presets'
counts: the two share their BPE). An oracle episode is a lower bound of a model's: a served user
simulator writes longer messages than the scripted one, and a policy that explores or retries
reads more tool results; docs/environments.md says how the presets' MAX_LEN is sized from these.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import envs  # noqa: E402
from common.envs.tau2 import tau2 as T  # noqa: E402
from common.envs.tau2 import tiny as tau2_tiny  # noqa: E402
from common.run import tiny  # noqa: E402
from common.seal import interface as omega_api  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the tiny build's)")
parser.add_argument("--domains", nargs="+", default=list(T.DOMAINS))
parser.add_argument("--limit", type=int, default=None, help="first K tasks of each split")
args = parser.parse_args()


class Longest:
    """A ScriptEngine that also keeps the longest prompt it was handed."""

    def __init__(self, engine):
        self.engine, self.tokenizer, self.stop_ids, self.longest = engine, engine.tokenizer, engine.stop_ids, 0

    def generate(self, prompts, max_new_tokens, temperature):
        gens = self.engine.generate(prompts, max_new_tokens, temperature)
        self.longest = max([self.longest] + [len(p) + len(g.ids) for p, g in zip(prompts, gens, strict=True)])
        return gens


from transformers import AutoTokenizer  # noqa: E402

tok = AutoTokenizer.from_pretrained(args.tokenizer or tiny.build_cached())
tok.chat_template = tiny.CHAT_TEMPLATE
name = os.path.basename(os.path.normpath(args.tokenizer)) if args.tokenizer else "tiny build"
print(f"tokenizer: {name} ({len(tok)} tokens); chat template: the tiny model's (Qwen2.5's tool format)")
print("| domain | episodes | opening prompt | longest context: median | p90 | max | steps max | s |")
print("|---|---|---|---|---|---|---|---|")
for domain in args.domains:
    t0 = time.perf_counter()
    openings, longest, steps = [], [], []
    for split in ("train", "test"):
        try:
            env = envs.load(f"tau2:{domain}:{split}", user="scripted")
        except Exception as e:  # noqa: BLE001 - a domain without that split
            print(f"{domain}:{split}: {e}", file=sys.stderr)
            continue
        for task in [t["tau2"] for t in env.tasks.values()][:args.limit]:
            script = T.OracleScript(task, "json", shared=False)
            engine = Longest(tiny.ScriptEngine(tok, lambda script=script: script.agent_text(None, None)))
            row, policy = tau2_tiny.tau2_play(env, task, script, engine, omega_api.initial(), evaluate=False)
            openings.append(policy.counts["prompt_tokens"])
            longest.append(max(engine.longest, len(policy.log)))
            steps.append(len(row["agent_steps"]))
    if not longest:
        continue
    q = statistics.quantiles(longest, n=10, method="inclusive")[-1] if len(longest) > 1 else longest[0]
    print(f"| {domain} | {len(longest)} | {statistics.median(openings):,.0f} (max {max(openings):,}) | "
          f"{statistics.median(longest):,.0f} | {q:,.0f} | {max(longest):,} | {max(steps)} | "
          f"{time.perf_counter() - t0:.0f} |")
