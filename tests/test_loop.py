"""loop.sh end to end on the tiny preset, on vLLM's server as GPU users run it: artifacts, modes,
KL reference and optimiser state handed from round to round, disk retention (KEEP), resume after an
interruption, no server left behind, trackers."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from common import presets
from common.engine import serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two rounds of 2 tasks x 2 samples, 1 held-in task per category, one model call per turn (a
# call ends the trajectory at the step limit): at this size process start-up is most of the cost.
SMALL = ["--rounds", "2", "--eval-every", "2", "--set", "TASKS_PER_ROUND=2", "--set", "N=2", "--set", "MAX_NEW=32",
         "--set", "EVAL_LIMIT=1", "--set", "MAX_STEPS=1"]
ARTIFACTS = ["config.json", "timing.jsonl", "report.md", "curves.png", "eval/round_001/scores.json",
             "round_002/interface.json", "round_001/policy/optimizer/trainer_state.json"] + [
                 f"round_00{t}/{f}" for t in (0, 1) for f in (
                     "interface.json", "rollouts.jsonl", "rollout_summary.json", "diagnoses.jsonl",
                     "train_metrics.jsonl")] + [
                 f"round_00{t}/policy/{f}" for t in (1,) for f in ("config.json", "model.safetensors", "tokenizer.json")]
# The seal run keeps the default KEEP=evaluated and logs to TensorBoard; the vanilla run keeps
# everything (KEEP=all) and plays on a server it did not start (SERVER=URL, the session's). (The
# train stage as loop.sh runs it under FSDP2: tests/test_train_grpo.py, two rounds.)
KEEP = {"seal": ["--set", "REPORT_TO=tensorboard"], "vanilla": ["--set", "KEEP=all"], "other": []}


def loop(runs, name, mode, *extra, stdout=subprocess.PIPE, **kw):
    cmd = ["bash", "loop.sh", "tiny", "--mode", mode, "--name", name, "--runs", str(runs), *SMALL, *KEEP[name], *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, **kw)


def finish(proc, log=None):
    out, _ = proc.communicate(timeout=900)
    out = out if log is None else log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


def jsonl(path):
    return [json.loads(line) for line in open(path)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory, tiny_model, tiny_server_state):
    """The two runs every test below reads, side by side. SEAL, the GPU users' path: vLLM's own
    server started by the loop, interrupted (Ctrl-C) inside round 0's evolve or train with the
    server up, then rerun to the end. Vanilla: uninterrupted, on the session's server (a server the
    user runs)."""
    runs = tmp_path_factory.mktemp("runs")
    run = runs / "seal"
    # The vanilla run plays beside the seal run (most of each is one busy core): it scores the
    # base model first, whose scores both share, and the seal run starts once they exist.
    url = json.loads(open(tiny_server_state).read())["url"]
    vanilla_log = tmp_path_factory.mktemp("vanilla") / "loop.out"
    with open(vanilla_log, "w") as log:
        vanilla = loop(runs, "vanilla", "vanilla", "--set", f"SERVER={url}", stdout=log)
    deadline = time.time() + 900
    while not (runs / "base-tiny" / "eval" / "scores.json").exists():
        assert vanilla.poll() is None and time.time() < deadline, vanilla_log.read_text()[-4000:]
        time.sleep(0.2)
    proc = loop(runs, "seal", "seal", start_new_session=True)
    deadline = time.time() + 900
    while not (run / "round_000" / "diagnoses.jsonl").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    time.sleep(1.0)
    server = json.loads((run / "server.json").read_text())
    os.killpg(proc.pid, signal.SIGINT)
    said = proc.communicate(timeout=120)[0]
    interrupted = {"returncode": proc.returncode, "said": said[-2000:], "server_pid": server["pid"],
                   "server_left": (run / "server.json").exists() or _alive(server["pid"]),
                   "policy": (run / "round_000" / "policy").exists(),
                   "rollouts_mtime": (run / "round_000" / "rollouts.jsonl").stat().st_mtime_ns}
    rerun = finish(loop(runs, "seal", "seal"))
    finish(vanilla, vanilla_log)
    return {"runs": runs, "interrupted": interrupted, "rerun": rerun}


@pytest.fixture(scope="module")
def runs(loop_runs):
    return loop_runs["runs"]


@pytest.mark.parametrize("mode", ["seal", "vanilla"])
def test_two_round_loop_leaves_every_artifact(runs, mode):
    run = runs / mode
    for rel in ARTIFACTS:
        assert (run / rel).is_file(), rel
    assert (runs / "base-tiny" / "eval" / "scores.json").is_file()
    config = json.loads((run / "config.json").read_text())
    assert config["settings"]["mode"] == mode and config["versions"]["bfcl-eval"] == "2026.3.23"
    assert config["git_commit"]
    stages = [(x["round"], x["stage"]) for x in jsonl(run / "timing.jsonl")]
    for t in (0, 1):
        for stage in ("rollout", "diagnose", "evolve", "train"):
            assert stages.count((t, stage)) == 1
    report = (run / "report.md").read_text()
    assert "| 0 |" in report and "| 1 |" in report and "round_001" in report

    # KL to the round-0 model in every round; round 1 continues round 0's optimiser
    model = os.path.abspath(os.path.join(ROOT, config["settings"]["model"]))
    carried = 0  # the tiny preset learns: a round may or may not step; the count carries over either way
    for t in (0, 1):
        lines = jsonl(run / f"round_00{t}" / "train_metrics.jsonl")
        assert {m["ref_model"] for m in lines} == {model}
        assert [m["global_step"] for m in lines] == [carried + m["step"] for m in lines]
        carried = lines[-1]["global_step"]
    assert "resuming optimiser state from" in (run / "logs" / "round_001_train.log").read_text()
    # disk: round 0 was not evaluated, so once round 1's policy exists it goes (KEEP=evaluated)
    if mode == "seal":
        assert not (run / "round_000" / "policy").exists() and (run / "round_000" / "policy.deleted").is_file()
    else:
        assert (run / "round_000" / "policy" / "optimizer" / "trainer_state.json").is_file()


def test_modes_differ_where_they_should(runs):
    seal, vanilla = runs / "seal", runs / "vanilla"
    s_omega = json.loads((seal / "round_000" / "interface.json").read_text())
    v_omega = json.loads((vanilla / "round_000" / "interface.json").read_text())
    assert s_omega["schema_cue"]["enabled"] and s_omega["error_feedback"]
    assert not v_omega["schema_cue"]["enabled"] and not v_omega["error_feedback"]
    assert not v_omega["capability_cues"]
    for t in (0, 1):
        s_roll = jsonl(seal / f"round_00{t}" / "rollouts.jsonl")
        v_roll = jsonl(vanilla / f"round_00{t}" / "rollouts.jsonl")
        assert all(r["stats"]["cue_tokens"] > 0 for r in s_roll)
        assert all(r["stats"]["cue_tokens"] == 0 for r in v_roll)
        # Same tasks in both modes (a fixed order per round), different prompts.
        assert [r["task_id"] for r in s_roll] == [r["task_id"] for r in v_roll]
        assert s_roll[0]["tokens"]["prompt_ids"] != v_roll[0]["tokens"]["prompt_ids"]
        # Diagnosis weights: ρ in SEAL, 1 everywhere in vanilla.
        s_w = [m["w_mean"] for m in jsonl(seal / f"round_00{t}" / "train_metrics.jsonl")]
        v_w = [m for m in jsonl(vanilla / f"round_00{t}" / "train_metrics.jsonl")]
        assert all(m["w_mean"] == 1.0 and m["w_std"] == 0.0 for m in v_w)
        assert any(w != 1.0 for w in s_w)
    # Evaluation never sees Ω: every evaluation, of the base model and of either mode's policy, shows
    # each held-in task the same first prompt, with no cue tokens and no interface.
    first = {}
    for path in (runs / "base-tiny" / "eval", seal / "eval" / "round_001", vanilla / "eval" / "round_001"):
        recs = jsonl(path / "rollouts.jsonl")
        assert recs and all(r["interface_version"] is None and r["stats"]["cue_tokens"] == 0 for r in recs)
        for r in recs:
            assert first.setdefault(r["task_id"], r["tokens"]["prompt_ids"]) == r["tokens"]["prompt_ids"], path


def test_interrupted_loop_resumes_and_leaves_no_server_behind(loop_runs, tiny_model):
    """Ctrl-C with the loop's server up stops the server's process group; the rerun keeps every
    finished stage, starts one server on the last complete policy, loads round 1's in place
    and checks each policy against the trainer's probe before it plays."""
    run, first, out = loop_runs["runs"] / "seal", loop_runs["interrupted"], loop_runs["rerun"]
    assert first["returncode"] == 130 and not first["server_left"], "the server outlived its loop"
    # it says where it stopped, as the stage lines name it (round 0's evolve or train)
    assert re.search(r"^loop: interrupted in round 0, (after diagnose|evolve|after evolve|train); "
                     r"rerun the same command to resume$", first["said"], re.M), first["said"]
    assert not first["policy"]  # interrupted inside round 0's evolve or train
    assert "round 0 rollout: done" in out and "round 0 diagnose: done" in out
    assert (run / "round_000" / "rollouts.jsonl").stat().st_mtime_ns == first["rollouts_mtime"]
    stages = [(x["round"], x["stage"]) for x in jsonl(run / "timing.jsonl")]
    assert len(stages) == len(set(stages)), "a finished stage ran twice"
    assert not list(run.rglob(".tmp-*")), "a half-written artifact was left behind"
    assert not (run / "server.json").exists()
    starts = [line for line in (run / "logs" / "server.log").read_text().splitlines() if line.startswith("# ")]
    # once per loop command: every new policy is loaded in place (tied embeddings too: common/engine/serve.py)
    assert len(starts) == 2, starts
    assert "in place" in out
    assert {r["policy"] for r in jsonl(run / "round_001" / "rollouts.jsonl")} == {str(run / "round_000" / "policy")}
    probe = json.loads((run / "round_001" / "policy" / serve.PROBE).read_text())
    assert probe["dtype"] == "float32" and len(probe["ids"]) == len(probe["logprobs"]) + 1
    # the same optimiser carried on from the interrupted round's rerun
    infos = json.loads((run / "round_001" / "policy" / "optimizer" / "trainer_state.json").read_text())
    lines = jsonl(run / "round_001" / "train_metrics.jsonl")
    assert infos["global_step"] == lines[-1]["global_step"]


def scalars(run):
    """{tag: [(step, value)]} as TensorBoard's own reader reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tracking" / "seal"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# One tag of each family (docs/tracking.md), logged at every round's step.
ROUND_TAGS = ["critic/score/mean", "reward_std", "frac_reward_zero_std", "response_length/mean", "response_length/max", "response_length/clip_ratio", "prompt_length/mean",
              "num_turns/mean", "rollout/steps/mean", "tools/calls_per_step", "tools/failure_frequency",
              "rollout/parse_error_rate", "seal/cue_tokens/mean", "seal/label/pass", "seal/w/mean", "seal/w/std", "seal/rho/pass",
              "seal/cue/schema", "seal/cue/error_feedback", "seal/cue/capability/invalid_tool_call",
              "timing_s/rollout", "timing_s/train", "timing_s/round", "perf/gen_throughput", "training/global_step"]
POLICY_TAGS = ["actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/grad_norm",
               "actor/lr", "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
               "seal/wa/mean", "perf/throughput"]


def test_the_viewer_loop_built_shows_every_round_in_a_browser(runs):
    """loop.sh rebuilt the viewer after every round: headless Chromium renders each round's rows,
    a filter, and a trajectory with its verdict and label (tests/helpers.py)."""
    from helpers import check_tiny_runs
    check_tiny_runs(runs)


def test_tensorboard_reads_back_every_round(runs):
    """REPORT_TO=tensorboard: one step per round with the figures its artifacts hold, held-in
    scores at 0 (base) and 2 (after round 1), the run's id and what was logged kept in the run."""
    run = runs / "seal"
    tags = scalars(run)
    for tag in ROUND_TAGS:
        assert [s for s, _ in tags.get(tag, [])] == [0, 1], tag
    for t in (0, 1):
        diag = jsonl(run / f"round_00{t}" / "diagnoses.jsonl")
        metrics = jsonl(run / f"round_00{t}" / "train_metrics.jsonl")
        assert tags["critic/score/mean"][t][1] == pytest.approx(sum(d["reward"] for d in diag) / len(diag))
        assert tags["training/global_step"][t][1] == metrics[-1]["global_step"]
        for c in {d["category"] for d in diag}:
            mine = [d["reward"] for d in diag if d["category"] == c]
            assert dict(tags[f"reward/{c}/mean"])[t] == pytest.approx(sum(mine) / len(mine))
            assert t in dict(tags[f"reward/{c}/pass_at_n"])
        assert sum(v[t][1] for k, v in tags.items() if k.startswith("seal/label/")) == pytest.approx(1)
        (train_s,) = [x["seconds"] for x in jsonl(run / "timing.jsonl") if (x["round"], x["stage"]) == (t, "train")]
        assert tags["timing_s/train"][t][1] == pytest.approx(train_s, abs=1e-3)
        # policy figures exist for a round that took optimiser steps (the tiny model may not)
        stepped = any(m["step"] > 0 for m in metrics)
        for tag in POLICY_TAGS:
            assert (t in [s for s, _ in tags.get(tag, [])]) == stepped, (tag, t)
    assert [s for s, _ in tags["val-core/heldin/average"]] == [0, 2]
    scores = json.loads((run / "eval" / "round_001" / "scores.json").read_text())
    assert tags["val-core/heldin/average"][1][1] == pytest.approx(scores["average"])
    state = json.loads((run / "tracking" / "state.json").read_text())
    assert len(state["run_id"]) == 32 and state["logged"]["tensorboard"] == ["eval base", "round 0", "round 1",
                                                                              "eval round 1"]


def test_a_tracker_that_is_not_installed_stops_before_round_0(tmp_path):
    from common.run import tracking
    missing = next((n for n in ("comet_ml", "swanlab", "clearml", "aim", "dvclive") if not tracking.installed(n)), None)
    if missing is None:
        pytest.skip("every tracker this test could name is installed")
    res = subprocess.run(
        ["bash", "loop.sh", "tiny", "--name", "bad", "--runs", str(tmp_path), *SMALL, "--set", f"REPORT_TO={missing}"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 2 and f"pip install {tracking.PACKAGES[missing]}" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "bad").exists()


def test_wandb_offline_writes_its_run_once(runs, tmp_path, monkeypatch):
    """W&B in offline mode (nothing leaves the machine), where wandb is installed: the run's
    figures go to runs/NAME/tracking/wandb/ under the run's id; a second call logs nothing."""
    pytest.importorskip("wandb")
    import shutil

    from common.run import tracking
    run = tmp_path / "seal"
    shutil.copytree(runs / "seal", run, ignore=shutil.ignore_patterns("policy", "tracking"))
    shutil.copytree(runs / "base-tiny", tmp_path / "base-tiny")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert tracking.log(str(run), "wandb") == {"wandb": ["eval base", "round 0", "round 1", "eval round 1"]}
    run_id = json.loads((run / "tracking" / "state.json").read_text())["run_id"]
    assert list((run / "tracking" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert tracking.log(str(run), "wandb") == {}


def test_compare_prints_runs_side_by_side(runs):
    res = subprocess.run([sys.executable, "evaluate.py", "--compare", str(runs / "seal"), str(runs / "vanilla")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "average" in lines[0]
    assert [ln.split()[0:2] for ln in lines[1:]] == [["tiny", "base"], ["seal", "r001"], ["vanilla", "r001"]]


def test_finished_loop_reruns_nothing_after_deletions(runs):
    """Round 0's policy is gone (KEEP=evaluated): a rerun must still find every round done.
    KEEP may change on a rerun (config.json follows); other settings may not."""
    run = runs / "seal"
    timing = (run / "timing.jsonl").read_text()
    logged = scalars(run)
    out = finish(loop(runs, "seal", "seal", "--set", "KEEP=latest"))
    assert "round 0 train: done" in out and "round 1 train: done" in out
    assert (run / "timing.jsonl").read_text() == timing
    assert scalars(run) == logged  # the tracker run got no step twice
    assert not (run / "round_000" / "policy").exists() and (run / "round_001" / "policy").is_dir()
    assert json.loads((run / "config.json").read_text())["settings"]["keep"] == "latest"
    bad = loop(runs, "seal", "seal", "--set", "LR=7e-7")
    out, _ = bad.communicate(timeout=300)
    assert bad.returncode != 0 and "-> '7e-7'" in out


def test_base_scores_are_shared_only_under_the_same_settings(runs):
    """Every run of a preset under one --runs reuses base-tiny's held-in scores, so a run that
    would score the base model with other limits stops before writing anything."""
    bad = loop(runs, "other", "seal", "--set", "EVAL_LIMIT=2")
    out, _ = bad.communicate(timeout=300)
    assert bad.returncode == 2 and "eval_limit: '1' -> '2'" in out and "use another --runs" in out, out[-2000:]
    assert not (runs / "other").exists()
    assert json.loads((runs / "base-tiny" / "config.json").read_text())["settings"]["eval_limit"] == "1"


def test_config_records_every_preset_variable(runs):
    """config.json holds one key per variable --set can change (common/presets.py's record), the
    model as the stages got it (the tiny model's folder)."""
    keys = presets.record(presets.PRESETS["tiny"], "tiny", "seal")
    settings = json.loads((runs / "seal" / "config.json").read_text())["settings"]
    assert "micro_tokens" in keys and "max_model_len" in keys and set(settings) == set(keys) | {"name"}
    assert os.path.isfile(os.path.join(ROOT, settings["model"], "config.json")) and settings["rounds"] == "2"
    assert settings["max_new_tokens"] == "32" and settings["max_steps"] == "1"  # SMALL's --set, under their keys
    assert settings["call_format"] == "json"  # the one the stages got: the handler's


def test_a_setting_recorded_later_is_taken_up_and_then_held(tmp_path):
    """A run whose config.json predates a setting (one loop.sh added since) resumes and records it;
    after that the key is checked like any other."""
    from common.run import runinfo
    path = str(tmp_path / "config.json")
    runinfo.main(path, ["lr=1e-6"])
    with pytest.raises(SystemExit, match="lr: '1e-6' -> '7e-7'"):
        runinfo.main(path, ["lr=7e-7", "micro_tokens=8192"])
    runinfo.main(path, ["lr=1e-6", "micro_tokens=8192"])
    assert json.loads(open(path).read())["settings"] == {"lr": "1e-6", "micro_tokens": "8192"}
    with pytest.raises(SystemExit, match="micro_tokens: '8192' -> '32768'"):
        runinfo.main(path, ["lr=1e-6", "micro_tokens=32768"])


def test_ood_without_a_user_simulator_stops_before_round_0(tmp_path, tiny_model):
    res = subprocess.run(
        ["bash", "loop.sh", "tiny", "--ood", "--name", "ood", "--runs", str(tmp_path), *SMALL],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 2 and "needs a user simulator" in res.stderr
    assert not (tmp_path / "ood").exists()


# (an unknown handler stops at the same line as a contradicting call format: tests/test_prompts.py)
@pytest.mark.parametrize("setting, message", [("CALL_FORMAT=python", "call format python contradicts QwenFCHandler"),
                                              ("PROMPTS=chat", "use bfcl or template")])
def test_a_bad_prompt_setting_stops_before_round_0(tmp_path, tiny_model, setting, message):
    res = subprocess.run(
        ["bash", "loop.sh", "tiny", "--name", "bad", "--runs", str(tmp_path), *SMALL, "--set", setting],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 2 and message in res.stderr
    assert not (tmp_path / "bad").exists()
