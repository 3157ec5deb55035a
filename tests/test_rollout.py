"""rollout.py and the multi-turn play loop (common/envs/bfcl/play.py), with the tiny model and real tasks.

The turn protocol (bfcl-eval's loop, and Ω's decode-failure rule) is checked on
the tiny model's own outputs through the recorded fields, and its decision rule
(`episode.turn_action`) on real environment steps. One prompt-rendering case needs
a fixed bad call (a cue rendered after it) and uses `Scripted`: fixed texts
tokenised by the real tokenizer, against the real environment.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import Scripted

from common.engine import episode
from common.engine.chat import Renderer
from common.engine.engines import Generation, make_engine
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play, prompts, tiny
from common.seal import interface as omega_api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The two shortest prompts of their categories (TradingBot only): the CPU cost of a step is the prefill.
TASK_IDS = ["multi_turn_base_105", "multi_turn_miss_func_146"]


@pytest.fixture(scope="module")
def tasks():
    return bfcl.load_tasks(os.path.join(ROOT, "data", "train.jsonl"))


def rollout_cli(tmp_path, model, engine, *extra, n=2, name="r.jsonl"):
    out = tmp_path / name
    cmd = [sys.executable, "rollout.py", "--model", model, "--tasks", "data/train.jsonl", "--task-ids",
           ",".join(TASK_IDS), "--n", str(n), "--engine", engine, "--max-new-tokens", "24",
           "--max-steps-per-turn", "2", "--seed", "3", "--out", str(out), *extra]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def conversation(task, record, omega=None):
    """The messages the record's tokens should spell, rebuilt from its transcript."""
    msgs = []
    for t, turn in enumerate(record["turns"]):
        revealed = bfcl.tools_at(task, t)[len(bfcl.tools_at(task, t - 1)):] if t else []
        shown = omega_api.tool_view(revealed, omega) if revealed else None
        msgs += bfcl.turn_messages(task, t, new_tools=shown)
        for s, step in enumerate(turn["steps"]):
            msgs.append({"role": "assistant", "content": step["text"]})
            last = t == len(record["turns"]) - 1 and s == len(turn["steps"]) - 1
            fed_back = step["calls"] or (step["parse_error"] and record["decode_failure"] == "feedback")
            if fed_back and not last:
                contents = list(step["results"])
                if step["parse_error"] and record["decode_failure"] == "feedback":  # skipped blocks: Ω's
                    contents.append(f"Error: could not parse tool calls: {step['parse_error']}")
                for i, err in enumerate(episode.hint_errors(step)[:len(contents)]):
                    hint = omega_api.error_hint(err, bfcl.tools_at(task, t), omega, play.HINT_RULES) if err else None
                    contents[i] += f"\n{hint}" if hint else ""
                msgs += [{"role": "tool", "content": c} for c in contents]
    return msgs


def check_record(task, rec, tokenizer, omega=None):
    toks = rec["tokens"]
    assert len(toks["ids"]) == len(toks["mask"]) == len(toks["logprobs"])
    assert sum(toks["mask"]) == rec["stats"]["gen_tokens"]
    assert all((lp is not None and lp <= 0) if m else lp is None for m, lp in zip(toks["mask"], toks["logprobs"],
                                                                                  strict=True))
    # The mask covers exactly the model's outputs: one run of 1s per step, decoding to its text.
    runs, cur = [], []
    for i, m in zip(toks["ids"], toks["mask"], strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    steps = [s for turn in rec["turns"] for s in turn["steps"]]
    assert len(runs) == len(steps)
    for run, step in zip(runs, steps, strict=True):
        assert episode.decode(tokenizer, Generation(run, [], "stop"), {tokenizer.eos_token_id}) == step["text"]
    # No drift: the prompt is bfcl-eval's QwenFCHandler prompt, and the whole context decodes
    # to what that handler adds around the model's own outputs for the conversation rebuilt
    # from the transcript (token-in/token-out).
    shown, system = omega_api.tool_view(bfcl.tools_at(task, 0), omega), omega_api.system_cue(omega)
    assert toks["prompt_ids"] == tokenizer(prompts.first_prompt(task, shown, system))["input_ids"]
    full = tiny.render(task, conversation(task, rec, omega), omega)
    decoded = tokenizer.decode(toks["prompt_ids"] + toks["ids"], skip_special_tokens=False)
    assert full.startswith(decoded) and full[len(decoded):] in ("\n", tokenizer.eos_token + "\n")


def test_hf_engine_writes_valid_records(tmp_path, tiny_model, tasks, tokenizer):
    check_rollout(tmp_path, tiny_model, tasks, tokenizer, "hf")


def test_vllm_server_writes_valid_records(tmp_path, tiny_model, tasks, tokenizer, tiny_server):
    # the session's server (a stage that starts its own is tests/test_tau.py's agent)
    check_rollout(tmp_path, tiny_model, tasks, tokenizer, "vllm", "--server", tiny_server)


def check_rollout(tmp_path, tiny_model, tasks, tokenizer, engine, *server):
    recs = rollout_cli(tmp_path, tiny_model, engine, *server)
    assert [(r["task_id"], r["sample_index"]) for r in recs] == [(t, k) for t in TASK_IDS for k in range(2)]
    for rec in recs:
        assert rec["interface_version"] is None and rec["stop"] in ("done", "step_limit", "context_limit")
        assert rec["stats"]["gen_tokens"] > 0 and rec["stats"]["cue_tokens"] == 0
        check_record(tasks[rec["task_id"]], rec, tokenizer)


def test_same_seed_same_records_on_hf(tiny_model, tasks):
    def run(temperature):
        engine = make_engine("hf", tiny_model, max_model_len=16384, seed=5)
        spec = play.PlaySpec(temperature=temperature, max_new_tokens=24, max_steps_per_turn=2)
        recs, _ = play.play([tasks["multi_turn_base_105"]], 2, engine, spec, progress=False)
        for r in recs:
            r["stats"].pop("seconds")
        return recs

    a, b = run(1.0), run(1.0)
    assert a == b
    # Samples of a group draw different random numbers. Shown at a temperature that flattens
    # any model's distribution: two temperature-1 samples of a peaked build may coincide.
    c = run(1e4)
    assert c[0]["tokens"]["ids"] != c[1]["tokens"]["ids"]


def test_context_limit_stops_the_trajectory_without_crashing_the_batch(tiny_model, tasks):
    short, long_ = tasks["multi_turn_base_105"], tasks["multi_turn_base_0"]
    engine = make_engine("hf", tiny_model, max_model_len=16384, seed=0)
    plen = len(play.Trajectory(short, 0, play.PlaySpec(), engine.tokenizer).log.prompt_ids)
    recs, _ = play.play([short, long_], 1, engine, play.PlaySpec(max_model_len=plen + 12, max_new_tokens=64),
                        progress=False)
    assert recs[0]["stop"] == "context_limit" and recs[0]["turns"][-1]["end"] == "context_limit"
    assert 0 < len(recs[0]["tokens"]["ids"]) and len(recs[0]["tokens"]["prompt_ids"]) + len(recs[0]["tokens"]["ids"]) <= plen + 12
    # The longer task's prompt alone does not fit: it stops before any generation.
    assert recs[1]["stop"] == "context_limit" and recs[1]["tokens"]["ids"] == []


def test_rollout_announces_held_tools_at_their_turn(tiny_model, tasks, tokenizer):
    """One generated token can hold no complete call, so under bfcl-eval's rule (Ω absent) every
    output ends its turn, whatever the model samples: the trajectory reaches every turn."""
    task = tasks["multi_turn_miss_func_0"]
    reveal = int(next(iter(task["missed_function"])))
    held = [t["name"] for t in task["missed_function"][str(reveal)]]
    engine = make_engine("hf", tiny_model, max_model_len=16384, seed=0)
    rec = play.play([task], 1, engine, play.PlaySpec(max_new_tokens=1), progress=False)[0][0]
    assert rec["stop"] == "done" and len(rec["turns"]) == len(task["questions"])
    assert all(len(turn["steps"]) == 1 and turn["end"] in ("answer", "decode_error") for turn in rec["turns"])
    prompt = tokenizer.decode(rec["tokens"]["prompt_ids"])
    for name in held:
        assert f'"name": "{name}"' not in prompt
    text = tokenizer.decode(rec["tokens"]["ids"])
    announce = text.index(bfcl.NEW_TOOLS_TEMPLATE.split("\n")[-1])
    for name in held:  # announced as bfcl-eval's harness does: the docs' Python repr
        assert f"'name': '{name}'" in text[:announce]
    check_record(task, rec, tokenizer)


def env_steps(task, texts, fmt="json"):
    """Step records of real model texts played through the environment on turn 0."""
    with bfcl.Environment(task) as env:
        env.start_turn(0)
        return [env.step(text, fmt) for text in texts]


def test_turn_action_is_bfcl_eval_loop(tasks):
    """After each step: end the turn on no calls (an undecodable output too, unless Ω's error
    feedback answers it), quit the task once a turn has had more than the limit (the 21st of 20)."""
    task = tasks["multi_turn_base_0"]
    call, answer, garbage = env_steps(task, ['<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', "Done.",
                                             '<tool_call>{"name": "ls", "arguments": {'])
    assert call["calls"] and not answer["calls"] and garbage["parse_error"]
    for rule in ("end_turn", "feedback"):
        assert episode.turn_action(answer, 1, rule, 20) == "end_turn"
        assert [episode.turn_action(call, k, rule, 20) for k in (1, 20, 21)] == ["continue", "continue", "force_quit"]
    assert episode.turn_action(garbage, 1, "end_turn", 20) == "end_turn"
    assert episode.turn_action(garbage, 1, "feedback", 20) == "continue"
    assert episode.turn_action(garbage, 21, "feedback", 20) == "force_quit"
    # A <tool_call> block bfcl-eval skips does not stop the others: the step runs them and goes on.
    partial, = env_steps(task, ['<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": ls}\n</tool_call>'])
    assert len(partial["calls"]) == 1 and partial["parse_error"]
    assert episode.turn_action(partial, 1, "end_turn", 20) == "continue"
    # A schema break or a refused name is still a step with calls: bfcl-eval ran (or tried) it.
    broken, refused = env_steps(task, ['<tool_call>\n{"name": "cd", "arguments": {"folder": 7}}\n</tool_call>',
                                       '<tool_call>\n{"name": "rm_all", "arguments": {}}\n</tool_call>'])
    assert broken["schema_errors"][0] and refused["schema_errors"][0]
    assert episode.turn_action(broken, 1, "end_turn", 20) == episode.turn_action(refused, 1, "end_turn", 20) == "continue"


@pytest.mark.parametrize("omega_kind, rule", [("absent", "end_turn"), ("off", "end_turn"), ("initial", "feedback")])
def test_play_loop_follows_the_decode_failure_rule_of_omega(tiny_model, tasks, tokenizer, omega_kind, rule):
    """The tiny model's own outputs (short generations, so many do not decode), under evaluation
    (Ω absent), Vanilla RL / w/o env-side (Ω off) and Ω_0: every step is handled as
    turn_action says, the record names the rule, and the tokens spell that conversation."""
    omega = {"absent": None, "off": omega_api.off(), "initial": omega_api.initial()}[omega_kind]
    engine = make_engine("hf", tiny_model, max_model_len=16384, seed=1)
    limit = 1
    spec = play.PlaySpec(omega=omega, max_new_tokens=12, max_steps_per_turn=limit)
    recs, _ = play.play([tasks[i] for i in TASK_IDS], 1, engine, spec, progress=False)
    failures = 0
    for rec in recs:
        assert rec["decode_failure"] == rule
        for t, turn in enumerate(rec["turns"]):
            steps = turn["steps"]
            actions = [episode.turn_action(s, k + 1, rule, limit) for k, s in enumerate(steps)]
            assert all(a == "continue" for a in actions[:-1]), actions  # only a turn's last step may end it
            ends = {"end_turn": ("decode_error" if steps[-1]["parse_error"] else "answer"), "force_quit": "step_limit"}
            if t < len(rec["turns"]) - 1 or rec["stop"] == "done":
                assert turn["end"] == ends[actions[-1]], (turn["end"], actions)
            if turn["end"] == "step_limit":
                assert len(steps) == limit + 1 and rec["stop"] == "step_limit" and t == len(rec["turns"]) - 1
            if rule == "feedback":
                assert turn["end"] != "decode_error"
            failures += sum(s["parse_error"] is not None for s in steps)
        check_record(tasks[rec["task_id"]], rec, tokenizer, omega)
    print(f"\n{omega_kind}: {failures} undecodable outputs, turn ends {episode.summary(recs)['turn_ends']}")


def test_cues_reach_the_prompt_masked_and_counted(tasks, tokenizer):
    """Ω's schema cue, error feedback and capability cues are in the context, as observation tokens."""
    task = tasks["multi_turn_base_0"]
    omega = omega_api.initial()
    omega["capability_cues"] = [{"label": "recovery_failure", "text": omega_api.CAPABILITY_TEXT["recovery_failure"]}]
    bad = '<tool_call>\n{"name": "cd", "arguments": {}}\n</tool_call>'
    rec = play.play([task], 1, Scripted(tokenizer, lambda p: bad), play.PlaySpec(omega=omega, max_steps_per_turn=2),
                    progress=False)[0][0]
    step = rec["turns"][0]["steps"][0]
    # The call ran (bfcl-eval runs it) and failed; the hint follows its schema break.
    assert step["schema_errors"] == ["cd: missing required parameter folder"] and step["call_errors"][0]
    assert step["feedback"] and "cd needs folder" in step["feedback"]
    prompt = tokenizer.decode(rec["tokens"]["prompt_ids"])
    assert "[required]" in prompt and omega_api.CAPABILITY_TEXT["recovery_failure"] in prompt
    obs = tokenizer.decode([i for i, m in zip(rec["tokens"]["ids"], rec["tokens"]["mask"], strict=True) if not m])
    assert step["feedback"] in obs
    assert rec["stats"]["cue_tokens"] >= len(tokenizer(step["feedback"], add_special_tokens=False)["input_ids"])
    check_record(task, rec, tokenizer, omega)
    # Evaluation: with Ω absent or switched off the prompt is the plain one, byte for byte.
    plain = play.Trajectory(task, 0, play.PlaySpec(), tokenizer).log.prompt_ids
    assert play.Trajectory(task, 0, play.PlaySpec(omega=omega_api.off()), tokenizer).log.prompt_ids == plain
    assert plain != rec["tokens"]["prompt_ids"]


def test_missing_model_folder_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "rollout.py", "--model", str(tmp_path / "none"), "--tasks",
                          "data/train.jsonl", "--engine", "hf", "--out", str(tmp_path / "r.jsonl")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and "not a model or adapter folder" in res.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_template_prompts_stay_an_option(tasks, tokenizer):
    """`--prompts template` (verl's convention): the chat template's own rendering, no drift."""
    task = tasks["multi_turn_base_0"]
    call = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    rec = play.play([task], 1, Scripted(tokenizer, lambda p: call), play.PlaySpec(max_steps_per_turn=1,
                    prompts="template"), progress=False)[0][0]
    r = Renderer(tokenizer, bfcl.tools_at(task, 0))
    assert rec["tokens"]["prompt_ids"] == tokenizer.apply_chat_template(
        bfcl.turn_messages(task, 0), tools=r.tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = r.text(conversation(task, rec), False)
    decoded = tokenizer.decode(rec["tokens"]["prompt_ids"] + rec["tokens"]["ids"], skip_special_tokens=False)
    assert full.startswith(decoded) and full[len(decoded):] in ("\n", tokenizer.eos_token + "\n")
    assert prompts.first_prompt(task) != tokenizer.decode(rec["tokens"]["prompt_ids"])


def test_a_stop_id_the_format_does_not_write_leaves_the_context(tasks, tokenizer):
    """A model whose generation config stops on two ids (Qwen2.5: <|im_end|> and <|endoftext|>):
    ending on the one the prompt format closes messages with keeps it; ending on the other drops
    it, and the context gets exactly the format's closing; the parsed text has neither."""
    task = tasks["multi_turn_base_0"]
    im_end, eot = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    call = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    for stop in (im_end, eot):
        class TwoStops(Scripted):
            def generate(self, prompts_, max_new_tokens, temperature, stop=stop):
                out = super().generate(prompts_, max_new_tokens, temperature)
                return [Generation(g.ids[:-1] + [stop], g.logprobs, "stop") for g in out]
        engine = TwoStops(tokenizer, lambda p: call)
        engine.stop_ids = [im_end, eot]
        rec = play.play([task], 1, engine, play.PlaySpec(max_steps_per_turn=1), progress=False)[0][0]
        step = rec["turns"][0]["steps"][0]
        assert step["text"] == call and step["calls"]
        generated = [i for i, m in zip(rec["tokens"]["ids"], rec["tokens"]["mask"], strict=True) if m]
        assert eot not in rec["tokens"]["ids"] and (im_end in generated) == (stop == im_end)
        check_record(task, rec, tokenizer)


def test_play_spec_is_built_once_from_the_flags():
    """A stage's flags become one PlaySpec (common/engine/playargs.py): the handler's call format, the
    schedule its engine runs, the stage's own settings; a spec that cannot be played is refused."""
    import argparse

    from common.engine import playargs
    parser = argparse.ArgumentParser()
    playargs.add_play_args(parser)
    spec = playargs.play_spec(parser.parse_args([]), parser, temperature=0.5)
    assert (spec.fmt, spec.schedule, spec.temperature, spec.max_steps_per_turn) == ("json", "async", 0.5, 20)
    spec = playargs.play_spec(parser.parse_args(["--engine", "hf", "--handler", "LlamaHandler"]), parser)
    assert (spec.fmt, spec.schedule, spec.handler, spec.max_model_len) == ("python", "lockstep", "LlamaHandler", 16384)
    for bad in (["--engine", "hf", "--schedule", "async"], ["--handler", "LlamaHandler", "--call-format", "json"]):
        with pytest.raises(SystemExit):
            playargs.play_spec(parser.parse_args(bad), parser)
    assert play.PlaySpec(handler="LlamaHandler").fmt == "python"  # the call format follows the handler
    for bad in ({"schedule": "eager"}, {"prompts": "raw"}, {"prompts": "template", "rerender": True},
                {"handler": "QwenFCHandler", "fmt": "python"}):
        with pytest.raises(ValueError):
            play.PlaySpec(**bad)
