"""Evaluation's re-rendered prompts: ids reused from the last prompt (`PromptIds`) vs every prompt encoded whole.

    .venv/bin/python bench/prompt_ids_bench.py [--repeats 2] [--every 1]

Plays the held-in tasks (every `--every`-th) as evaluate.py does (bfcl-eval's prompts,
re-rendered each step, `play.run`), the policy writing the ground-truth calls and then an
answer, so no model time hides the play loop's own: once with each step's prompt ids from
`PromptIds`, once encoding every prompt whole (what the play loop did before), alternately in
one process. Checks that both give the same ids; prints seconds and the ratio.
Tokenizer: the tiny model's (4k vocabulary); a real model's encodes cost more per character.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import bfcl, play  # noqa: E402
from common import calls as C  # noqa: E402
from common.engines import Generation  # noqa: E402
from common.models import load_tokenizer  # noqa: E402
from common.tiny import build_cached  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=2)
parser.add_argument("--every", type=int, default=1)
args = parser.parse_args()


class Oracle:
    """Writes the ground-truth calls of the turn, then a plain answer; no model."""

    def __init__(self, tokenizer, trajs):
        self.tokenizer, self.trajs = tokenizer, trajs
        self.stop_ids = [tokenizer.eos_token_id]

    def generate(self, prompts, max_new_tokens, temperature):
        out = []
        for t in self.trajs:
            if t.stop is not None:
                continue
            turn, step = len(t.turns) - 1, len(t.turns[-1]["steps"])
            gt = bfcl.ground_truth_calls(t.task, turn)
            text = C.format_calls(gt, "json") if gt and step == 0 else "Done."
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(Generation(ids=ids, logprobs=[0.0] * len(ids), finish="stop"))
        return out


root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tasks = list(bfcl.load_tasks(os.path.join(root, "data", "heldin.jsonl")).values())[:: args.every]
tok = load_tokenizer(build_cached())
reused = play.HandlerView._encode
SPEC = play.PlaySpec(temperature=0.0, max_model_len=1 << 30, max_new_tokens=4096, rerender=True)


def whole(self, text):
    return self.tok(text)["input_ids"]


def run(encode):
    play.HandlerView._encode = encode
    ids, start = [], time.perf_counter()
    for task in tasks:  # one at a time: the oracle answers the one trajectory in play
        t = play.Rerendered(task, 0, SPEC, tok, stop_ids=[tok.eos_token_id])
        play.run([t], Oracle(tok, [t]), SPEC, progress=False)
        ids.append(t.next_prompt)
    return time.perf_counter() - start, ids


print(f"prompt ids bench, {time.strftime('%Y-%m-%d')}: {len(tasks)} held-in tasks played by the oracle, "
      f"re-rendered; {args.repeats} alternating runs; load average {os.getloadavg()[0]:.1f}")
sums = {"reused": 0.0, "whole": 0.0}
for _ in range(args.repeats):
    s_reused, a = run(reused)
    s_whole, b = run(whole)
    assert a == b, "PromptIds gave other ids than whole encodes"
    sums["reused"] += s_reused
    sums["whole"] += s_whole
for name, s in sums.items():
    print(f"  {name:7s} {s / args.repeats:6.1f} s a run")
print(f"  reused / whole: {sums['reused'] / sums['whole']:.2f} of the time; ids equal")
