"""The run viewer at a qwen7b run's size: build time per round, and what the page loads and how long it takes to show.

    .venv/bin/python bench/view_bench.py [--rounds 18] [--tasks 32] [--n 8] [--step-chars 3400] [--eval-tasks 400]

A synthetic run (tests/helpers.py synthetic_run: records in docs/design.md §3's formats) of
`rounds` rounds x tasks x n trajectories of real training tasks, long model texts and tool
results (about 16k tokens of prompt and ids each), and held-in evaluations of `eval-tasks` tasks
every 6 rounds and of the base model. Round 0's artifacts are written once and linked into the
other rounds (the builder reads each round's files all the same). Measures, with `python -m
common.run.view` as loop.sh runs it: the first build (every round and evaluation), the rebuild after
a round (what loop.sh pays every round), the bytes the page loads when it opens (page, script,
stylesheet, run data and the newest round's data, which the opening view shows) and the time
headless Chromium takes from navigation to the rendered round table and to a trajectory.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.envs.bfcl.harness import load_tasks  # noqa: E402
from tests.helpers import CHROMIUM, Tree, synthetic_run  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rounds", type=int, default=18)
parser.add_argument("--tasks", type=int, default=32, help="tasks per round")
parser.add_argument("--n", type=int, default=8, help="samples per task")
parser.add_argument("--step-chars", type=int, default=3400, help="characters of each model text and tool result")
parser.add_argument("--eval-tasks", type=int, default=400)
parser.add_argument("--eval-every", type=int, default=6)
args = parser.parse_args()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def view(run):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "common.run.view", run], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def opened(page, fragment):
    """(ms from navigation to the rendered view, as the page records it, and the rows it shows)."""
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                              "--disable-background-networking", "--disable-component-update", "--disable-sync",
                              f"--user-data-dir={profile}", "--dump-dom", f"file://{page}#{fragment}"],
                             capture_output=True, text=True, timeout=300, check=True).stdout
    body = next(Tree(out).root.all("body"))
    return int(body.attrs["data-ms"]), sum(1 for _ in body.all("tr", cls="traj"))


def link_tree(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        os.link(os.path.join(src, name), os.path.join(dst, name))


with tempfile.TemporaryDirectory() as tmp:
    run = os.path.join(tmp, "qwen7b-seal")
    tasks = list(load_tasks(os.path.join(ROOT, "data", "train.jsonl")).values())[: args.tasks]
    heldin = list(load_tasks(os.path.join(ROOT, "data", "heldin.jsonl")).values())[: args.eval_tasks]
    t0 = time.perf_counter()
    synthetic_run(run, tasks, heldin, rounds=1, n=args.n, step_chars=args.step_chars, hostile=False)
    for t in range(1, args.rounds):
        link_tree(os.path.join(run, "round_000"), os.path.join(run, f"round_{t:03d}"))
    first_eval = os.path.join(run, "eval", "round_000")
    for t in range(args.eval_every - 1, args.rounds, args.eval_every):
        link_tree(first_eval, os.path.join(run, "eval", f"round_{t:03d}"))
    link_tree(first_eval, os.path.join(tmp, "base-synthetic", "eval"))
    shutil.rmtree(first_eval)
    config = json.load(open(os.path.join(run, "config.json")))
    config["settings"]["rounds"] = str(args.rounds)
    json.dump(config, open(os.path.join(run, "config.json"), "w"))
    rollouts = [json.loads(line) for line in open(os.path.join(run, "round_000", "rollouts.jsonl"))]
    lengths = [len(r["tokens"]["prompt_ids"]) + len(r["tokens"]["ids"]) for r in rollouts]
    round_mb = os.path.getsize(os.path.join(run, "round_000", "rollouts.jsonl")) / 1e6
    print(f"synthetic run: {args.rounds} rounds x {len(rollouts)} trajectories ({min(lengths)}-{max(lengths)} tokens, "
          f"mean {sum(lengths) / len(lengths):.0f}; rollouts.jsonl {round_mb:.0f} MB a round), "
          f"{len(heldin)}-task evaluations; written in {time.perf_counter() - t0:.0f} s")

    cold = view(run)
    last = os.path.join(run, f"round_{args.rounds - 1:03d}", "diagnoses.jsonl")
    shutil.copyfile(last, last + ".new")  # a new round's own file, no longer a link to round 0's
    os.replace(last + ".new", last)
    again = view(run)
    unchanged = view(run)
    out = os.path.join(run, "viewer")
    size = lambda *p: os.path.getsize(os.path.join(out, *p))  # noqa: E731
    at_open = sum(size(f) for f in ("index.html", "view.js", "view.css")) + size("data", "run.js")
    newest = size("data", f"round_{args.rounds - 1:03d}.js")
    print(f"build: first {cold:.1f} s ({args.rounds} rounds and {len(os.listdir(os.path.join(run, 'eval'))) + 1} "
          f"evaluations); after a round {again:.1f} s; nothing changed {unchanged:.1f} s")
    print(f"loaded at open: page, script, stylesheet and run data {at_open / 1e3:.0f} kB, "
          f"+ the newest round's data {newest / 1e6:.1f} MB (the view it opens on); "
          f"an evaluation's data {size('data', f'eval_round_{args.eval_every - 1:03d}.js') / 1e6:.1f} MB")
    if CHROMIUM:
        page = os.path.join(out, "index.html")
        for fragment in ("", "run", f"eval/round_{args.eval_every - 1:03d}", f"traj/{args.rounds - 1}/{rollouts[-1]['task_id']}/{args.n - 1}"):
            times = [opened(page, fragment) for _ in range(3)]
            print(f"headless Chromium, #{fragment or ' (opening view)'}: rendered in "
                  f"{min(ms for ms, _ in times)}-{max(ms for ms, _ in times)} ms ({times[0][1]} rows)")
    else:
        print("no chromium on PATH: page times not measured (bash setup.sh installs it)")
