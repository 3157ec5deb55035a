"""Token cost of the training-time interface Ω on the training split, per cue family.

    python bench/interface_cost.py [--tasks data/train.jsonl] [--tokenizer DIR] \
        [--rollouts runs/x/round_000/rollouts.jsonl] [--errors-per-trajectory 2]

Counts with the tiny model's tokenizer (common.run.tiny.build_cached(), or --tokenizer):

- schema cue: tokens of the annotated minus the plain tool list, per task; the list
  rendered as a chat template does, one json.dumps line per tool (common.engine.chat's
  JSON-schema form), plus the annotation of tools revealed later (miss_func);
- capability cues: tokens of system_cue() with the 3 longest lines (an upper bound);
- error feedback: mean tokens per hint over the leakage audit's error cases
  (tests/helpers.py audit, without the synthetic env_template fills), times the number of
  errors per trajectory: measured from --rollouts (the errors common.engine.episode.hint_errors
  gives hints for: calls that broke the schema, ran or not, or failed, plus parse
  errors), else assumed (--errors-per-trajectory).

Share of context = cue tokens / (plain trajectory + all cue tokens), the plain
trajectory being the tool list, every user message, and the ground-truth calls
(as <tool_call> JSON) with their results: a lower bound on a real trajectory's
length, so the shares are upper bounds.
"""

import argparse
import json
import os
import sys
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere

from common.engine import calls as C  # noqa: E402
from common.engine.chat import to_chat_tools  # noqa: E402
from common.engine.episode import hint_errors  # noqa: E402
from common.envs.bfcl import harness as bfcl  # noqa: E402
from common.jsonl import read_jsonl  # noqa: E402
from common.seal import interface as I  # noqa: E402
from tests.helpers import audit  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--tasks", default=os.path.join(ROOT, "data", "train.jsonl"))
parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the tiny model's)")
parser.add_argument("--rollouts", default=None, help="rollouts.jsonl to measure errors per trajectory")
parser.add_argument("--errors-per-trajectory", type=float, default=2.0, help="assumed when no --rollouts")
args = parser.parse_args()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoTokenizer  # noqa: E402

if args.tokenizer is None:
    from common.run.tiny import build_cached
    args.tokenizer = build_cached()
tok = AutoTokenizer.from_pretrained(args.tokenizer)
cache = {}


def ntok(text):
    if text not in cache:
        cache[text] = len(tok(text, add_special_tokens=False)["input_ids"])
    return cache[text]


def tool_list(schemas):
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in to_chat_tools(schemas))


tasks = list(bfcl.load_tasks(args.tasks).values())
omega = I.initial()

# Plain trajectories and the schema cue, per task.
plain, schema = [], []
for task in tasks:
    tokens = ntok(tool_list(task["tools"]))
    cue = ntok(tool_list(I.tool_view(task["tools"], omega))) - tokens
    with bfcl.Environment(task) as env:
        for turn in range(len(task["questions"])):
            revealed = env.start_turn(turn)
            shown = bfcl.turn_messages(task, turn, new_tools=I.tool_view(revealed, omega) if revealed else None)
            tokens += sum(ntok(m["content"]) for m in bfcl.turn_messages(task, turn))
            if revealed:
                cue += ntok(shown[0]["content"]) - ntok(bfcl.turn_messages(task, turn)[0]["content"])
            for call in bfcl.ground_truth_calls(task, turn):
                results, _ = env.run_calls([call])
                tokens += ntok(C.format_calls([call], "json")) + ntok(results[0])
    plain.append(tokens)
    schema.append(cue)

# Capability cues: the three longest lines.
longest = sorted(I.CAPABILITY_TEXT.items(), key=lambda kv: -ntok(kv[1]))[:3]
capability = ntok(I.system_cue({**omega, "capability_cues": [{"label": z, "text": t} for z, t in longest]}))

# Error feedback: hints of the audit's error cases.
per_class = defaultdict(list)
for task in tasks:
    for case in audit(task, omega):
        if case["cue"] and case["case"] not in ("schema_cue", "capability_cue", "env_template"):
            per_class[I.error_class(case["error"])[0]].append(ntok(case["cue"]))
hint_tokens = [n for ns in per_class.values() for n in ns]
mean_hint = sum(hint_tokens) / len(hint_tokens)
if args.rollouts:
    counts = Counter()
    rollouts = read_jsonl(args.rollouts, required=["turns"])
    for k, r in enumerate(rollouts):
        for turn in r["turns"]:
            for step in turn["steps"]:
                counts[k] += sum(e is not None for e in hint_errors(step))
    errors, source = sum(counts.values()) / len(rollouts), f"measured on {len(rollouts)} rollouts"
else:
    errors, source = args.errors_per_trajectory, "assumed"
error_cost = mean_hint * errors

# Report.
mean_plain = sum(plain) / len(plain)
mean_schema = sum(schema) / len(schema)
total = mean_plain + mean_schema + capability + error_cost
print(f"{len(tasks)} tasks of {args.tasks}; tokenizer {args.tokenizer}")
print(f"plain trajectory: {mean_plain:.0f} tokens on average (tool list, user messages, ground-truth calls "
      "and results)\n")
print(f"{'cue family':<18} {'tokens/trajectory':>18} {'share of context':>17}  how")
rows = [("schema cue", mean_schema, f"annotated - plain tool list (max {max(schema)})"),
        ("capability cues", capability, "3 longest lines"),
        ("error feedback", error_cost, f"{errors:.2f} errors ({source}) x {mean_hint:.1f} tokens per hint"),
        ("all", mean_schema + capability + error_cost, "")]
for name, tokens, how in rows:
    print(f"{name:<18} {tokens:>18.1f} {100 * tokens / total:>16.2f}%  {how}")
print("\nerror hint tokens by class (audit cases):")
for name, ns in sorted(per_class.items(), key=lambda kv: -len(kv[1])):
    print(f"  {name:<18} {len(ns):>6} cases  mean {sum(ns) / len(ns):6.1f}  max {max(ns)}")
