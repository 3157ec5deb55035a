"""What a build of the tiny model samples (common/run/tiny.py), measured on demand (minutes on CPU).

    .venv/bin/python bench/tiny_measure.py [--temperatures 1.0 0.7] [--samples 8] [--eval-tasks 32] [--model DIR]
    .venv/bin/python bench/tiny_measure.py --env tau2:airline [--temperatures 1.0] [--samples 16]

Prints, as JSON: the first-step parse rate (greedy first output of `--eval-tasks` training tasks
with their full turn-0 prompt, parsed as at least one tool call) and, per view of the tool list
(plain, Ω's schema cue) and temperature, the sampled reward on the preset's tasks as its round 0
plays them: per task the samples the official checker solved, and the share of mixed groups
(some but not all solved), GRPO's signal. The model is the cached build (`build_cached()`) unless
--model names another. docs/learning-on-cpu.md quotes it. With --env tau2:DOMAIN: the τ² build and
the tasks its loop plays (the domain's first Tau2Env.TINY_TASKS train tasks, against the scripted user),
scored by τ²'s evaluator; no parse rate.
"""

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from common.envs.bfcl import tiny as bfcl_tiny  # noqa: E402
from common.run import tiny  # noqa: E402

MEASURE = {
    "seed": 0,
    "eval_tasks": 32,
    "eval_max_new_tokens": 128,
    "check_samples": 8,
    "check_max_new_tokens": int(tiny.TINY.max_new),  # as the preset's rollouts play
    "check_max_steps": int(tiny.TINY.max_steps),
}


def measure(model_dir, *, temperatures=(1.0, 0.7), samples=None, eval_tasks=None, tasks_path=bfcl_tiny.DEFAULT_TASKS,
            preset_path=bfcl_tiny.PRESET_TASKS, env="bfcl"):
    """What the tests do not measure, on demand: the first-step parse rate on `eval_tasks`
    training tasks (greedy) and the sampled reward on the preset's tasks, per view of the tool
    list and temperature: per task the samples the official checker solved, and the share of
    mixed groups (some but not all solved), GRPO's signal."""
    from common import envs
    from common.envs.bfcl import harness as bfcl
    from common.envs.tau2 import Tau2Env
    from common.seal import interface as omega_api

    m = {**MEASURE, **({"check_samples": samples} if samples else {}),
         **({"eval_tasks": eval_tasks} if eval_tasks is not None else {})}
    if env != "bfcl":  # the τ² loop's tasks and room for its calls (common/envs/tau2 Tau2Env.preset)
        m.update(eval_tasks=0, check_max_new_tokens=Tau2Env.TINY_MAX_NEW)
        played = envs.load(f"{env}:train", user="scripted")
        preset = list(played.tasks.values())[:Tau2Env.TINY_TASKS]
    else:
        played = envs.load(preset_path)
        preset = list(played.tasks.values())
    out = {"model": model_dir, "env": env, "settings": m}
    t0 = time.time()
    if m["eval_tasks"]:
        tasks = list(bfcl.load_tasks(tasks_path).values())
        tiny._log(f"measuring the first-step parse rate: greedy first output on {m['eval_tasks']} tasks")
        rate, _ = first_step_parse_rate(model_dir, pick_eval_tasks(tasks, m["eval_tasks"]), m["eval_max_new_tokens"])
        out["first_step_parse_rate"] = round(rate, 4)
    out["sampled_reward"] = {}
    for view, omega in (("plain", None), ("schema_cue", omega_api.initial())):
        for temp in temperatures:
            tiny._log(f"measuring the sampled reward ({view} view, temperature {temp}): {m['check_samples']} "
                 f"samples of each of {len(preset)} tasks")
            out["sampled_reward"][f"{view} T={temp}"] = preset_reward(
                model_dir, played, preset, {**m, "check_temperature": temp}, omega=omega)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def pick_eval_tasks(tasks, n):
    """`n` tasks whose turn 0 has ground-truth calls, round-robin over categories in file order."""
    by_cat = {}
    for t in tasks:
        if t["ground_truth"][0]:
            by_cat.setdefault(t["category"], []).append(t)
    return [t for rank in itertools.zip_longest(*by_cat.values()) for t in rank if t is not None][:n]


def preset_reward(model_dir, env, tasks, args, engine=None, omega=None):
    """Sampled reward on `tasks` of the environment `env` (common/envs/__init__.py) as the preset's rollouts
    play them (under the interface `omega`): `check_samples` per task at `check_temperature`, scored
    by the environment's own verdict. {"mean", "per_task": {id: mean}, "solved": {id: samples
    solved}, "mixed": share of tasks whose samples are neither all solved nor all failed}."""
    from common.engine.engines import make_engine
    from common.envs.bfcl import play

    own = engine is None
    if own:
        engine = make_engine("hf", model_dir, max_model_len=tiny.DEFAULTS["max_positions"], seed=args["seed"])
    try:
        spec = play.PlaySpec(omega=omega, temperature=args["check_temperature"],
                             max_steps_per_turn=args["check_max_steps"], max_model_len=tiny.DEFAULTS["max_positions"],
                             max_new_tokens=args["check_max_new_tokens"])
        records, _ = env.play(tasks, args["check_samples"], engine, spec)
    finally:
        if own:
            engine.close()
    by_id = {t["id"]: t for t in tasks}
    per_task = {}
    for r in records:
        per_task.setdefault(r["task_id"], []).append(env.diagnose(by_id[r["task_id"]], r)["reward"])
    rewards = [x for v in per_task.values() for x in v]
    return {"mean": round(sum(rewards) / len(rewards), 4),
            "per_task": {k: round(sum(v) / len(v), 3) for k, v in per_task.items()},
            "solved": {k: sum(v) for k, v in per_task.items()},
            "mixed": round(sum(0 < sum(v) < len(v) for v in per_task.values()) / len(per_task), 4)}



def first_step_parse_rate(model_dir, tasks, max_new_tokens, engine=None):
    """Fraction of tasks whose greedy first output (full turn-0 prompt) parses as >= 1 tool call."""
    from common.engine import calls as C
    from common.engine.engines import make_engine
    from common.envs.bfcl.prompts import first_prompt

    own = engine is None
    if own:
        engine = make_engine("hf", model_dir, max_model_len=tiny.DEFAULTS["max_positions"], seed=0)
    try:
        tok = engine.tokenizer
        prompts = [tok(first_prompt(t))["input_ids"] for t in tasks]
        gens = engine.generate(prompts, [max_new_tokens] * len(prompts), 0.0)
    finally:
        if own:
            engine.close()
    ok, samples = 0, []
    for task, g in zip(tasks, gens, strict=True):
        text = tok.decode(g.ids, skip_special_tokens=True)
        calls, err = C.parse(text, "json")
        good = bool(calls) and err is None
        ok += good
        samples.append({"task_id": task["id"], "text": text[:200], "parsed": good, "error": err})
    return ok / max(1, len(tasks)), samples


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a tiny model folder (default: the cached build, built if missing)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--samples", type=int, default=MEASURE["check_samples"], help="samples per task")
    p.add_argument("--eval-tasks", type=int, default=MEASURE["eval_tasks"],
                   help="training tasks for the first-step parse rate (0: skip)")
    p.add_argument("--env", default="bfcl", help="bfcl, or tau2:DOMAIN: the τ² build on its loop's tasks")
    a = p.parse_args(argv)
    folder = a.model or tiny.build_cached(env=a.env)
    print(json.dumps(measure(folder, temperatures=a.temperatures, samples=a.samples, eval_tasks=a.eval_tasks,
                             env=a.env), indent=1))


if __name__ == "__main__":
    main()
