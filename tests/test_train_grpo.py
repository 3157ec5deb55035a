"""train_grpo.py end to end on a tiny random Qwen2 (built here, no hub): it learns in the
direction of the weighted advantage, --no-reweight changes the update by exactly w,
2 DDP or FSDP2 processes on CPU give the 1-process update (FSDP2 holding no unsharded
gradient between micro-batches; two machine ranks give the 2-process one), LoRA adapters
save (their weights alone gathered), load and continue, on one process and under bf16 FSDP2
on a bf16 base, the optimiser state (torch.distributed.checkpoint) carries across rounds
(one process, DDP and FSDP2; a killed round reruns to the same state, bit for bit; a bf16
policy resumes from the float32 master; a 2-process state loads on one process), the KL
reference stays the initial policy, and bad input stops with file:line and no output.
Trajectories cut by training's own limits leave the loss, every step logs the policy's entropy and
the rollout correction's shares, and a record without engine log-probs is refused unless the
correction is off.
A multi-process run past its timeout prints every rank's stack (faulthandler, SIGABRT) and is
killed with its ranks, which torchrun starts in sessions of their own.
"""

import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import in_process
from safetensors.torch import load_file

from common.engine import serve
from common.jsonl import read_jsonl
from common.train.distributed import distributed_plugins, gradient_dtypes
from common.train.grpo import collate, join_trajectories, sequence_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_grpo.py")
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "PYTHONFAULTHANDLER": "1"}  # fmt: skip

# task -> rewards of its 4 samples; t2 has no variance and must be left out of the update
REWARDS = {"t0": [1, 0, 0, 1], "t1": [0, 0, 0, 1], "t2": [0, 0, 0, 0], "t3": [1, 1, 0, 1]}
# every turn carries this label, so w_j = ρ(label) for all j; the weighted run takes ρ from an
# interface file that sets it to 1.6 (the default table says 1.5)
LABEL, W = "missing_tool_call", 1.6
# one task per mini-batch: the 3 groups with differing rewards make 3 optimiser steps an epoch
COMMON = ["--lr", "1e-3", "--mini-batch-tasks", "1", "--max-tokens-per-micro-batch", "100", "--cpu"]


def make_data(folder, rewards=REWARDS, seed=0, temperature=1.0):
    """Rollout and diagnosis files in the docs/design.md §3 format: a task prompt shared by its samples,
    then model tokens (mask 1), a tool response (mask 0), model tokens again."""
    rng = random.Random(seed)
    rollouts, diagnoses = [], []
    for tid, rs in rewards.items():
        prompt = [rng.randrange(512) for _ in range(rng.randint(14, 24))]
        for k, r in enumerate(rs):
            parts = [(rng.randint(4, 10), 1), (rng.randint(3, 8), 0), (rng.randint(3, 8), 1)]
            if (tid, k) == ("t1", 0):  # a long tool response: with 2 processes one gets an idle micro-batch
                parts[1] = (40, 0)
            ids = [rng.randrange(512) for n, _ in parts for _ in range(n)]
            mask = [m for n, m in parts for _ in range(n)]
            logprobs = [-rng.uniform(5, 7) if m else None for m in mask]
            rollouts.append({
                "task_id": tid, "category": "base", "sample_index": k, "round": 0, "policy": "p0",
                "interface_version": 0, "turns": [{"steps": [], "end": "answer"}], "stop": "done",
                "tokens": {"prompt_ids": prompt, "ids": ids, "mask": mask, "logprobs": logprobs},
                "stats": {"gen_tokens": sum(mask), "cue_tokens": 0, "seconds": 0.1},
            } | ({"sampling": {"temperature": temperature, "top_p": 1.0, "top_k": 0}} if temperature else {}))  # fmt: skip
            diagnoses.append({
                "task_id": tid, "sample_index": k, "round": 0, "reward": r,
                "official": {"valid": bool(r), "error_type": None, "turn": None},
                "turn_labels": [LABEL], "evidence": [""], "profile": {LABEL: 1.0},
            })  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, recs in (("rollouts", rollouts), ("diagnoses", diagnoses)):
        paths[name] = os.path.join(folder, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    return paths["rollouts"], paths["diagnoses"]


LAUNCH_TIMEOUT = 300  # seconds a launched training run may take (its stdout read included)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_launcher():
    """accelerate launch over 2 CPU processes, on a port of its own: a rank still holding
    accelerate's default 29500 (another suite, a run that hung) would stall the rendezvous."""
    return [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]


def fsdp_launcher():
    """accelerate launch with FSDP2 over 2 CPU processes (configs/accelerate/fsdp_cpu.yaml), on a port of its own."""
    return [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
            os.path.join(ROOT, "configs", "accelerate", "fsdp_cpu.yaml"), "--main_process_port", str(free_port())]


def kill_tree(pid, sig=signal.SIGKILL):
    """`pid` and every process under it: torchrun starts each rank in a session of its own,
    so killing the launcher's process group would leave the ranks running."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def run_train(model, rollouts, diagnoses, out, *extra, launcher=(), script=SCRIPT):
    """train_grpo.py's run: launched over processes with `launcher`, else its main() in this
    process (see in_process)."""
    if script == SCRIPT and not launcher:
        return in_process(["--model", model, "--rollouts", rollouts, "--diagnoses", diagnoses, "--out", out, *extra])
    cmd = [*launcher, script]
    if script == SCRIPT:
        cmd += ["--model", model, "--rollouts", rollouts, "--diagnoses", diagnoses, "--out", out, *extra]
    else:
        cmd += [model, rollouts, diagnoses, out]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        # where every rank waits (PYTHONFAULTHANDLER prints each thread's stack on SIGABRT), then gone
        kill_tree(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=20)
        finally:
            kill_tree(proc.pid)
        pytest.fail(f"{' '.join(cmd)} ran past {LAUNCH_TIMEOUT} s:\n{stdout}\n{stderr[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def ok(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def metrics_of(out):
    return read_jsonl(os.path.join(os.path.dirname(out), "train_metrics.jsonl"))


def load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def mean_logprobs(model, trajectories):
    """Mean log-prob over each trajectory's model tokens (mask 1)."""
    out = []
    with torch.no_grad():
        for t in trajectories:
            b = collate([t], "cpu")
            lp = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["off"])
            out.append(lp[b["mask"]].mean().item())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    folder = str(tmp_path_factory.mktemp("tiny") / "model")
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    config = json.load(open(os.path.join(folder, "config.json")))
    with open(os.path.join(folder, "config.json"), "w") as f:  # as a Qwen checkpoint says
        json.dump(config | {"dtype": "bfloat16"}, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"note": "stands in for the tokenizer files that must travel with the policy"}, f)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def weighted_run(tiny, data, tmp_path_factory):
    """One process, w = 1.6 everywhere, 2 epochs of 3 mini-batches = 6 optimiser steps."""
    folder = tmp_path_factory.mktemp("weighted")
    interface = folder / "interface.json"
    interface.write_text(json.dumps({"version": 0, "round": 0, "rho": {LABEL: W, "pass": 1.0}}))
    out = str(folder / "policy")
    ok(run_train(tiny, *data, out, *COMMON, "--epochs", "2", "--interface", str(interface)))
    return out


def test_learns_towards_weighted_advantage(tiny, data, weighted_run):
    trajs = join_trajectories(read_jsonl(data[0]), read_jsonl(data[1]), {LABEL: W})
    before = mean_logprobs(load(tiny), trajs)
    after = mean_logprobs(load(weighted_run), trajs)
    up = [a - b for a, b, t in zip(after, before, trajs, strict=True) if t.weight * t.advantage > 0]
    down = [a - b for a, b, t in zip(after, before, trajs, strict=True) if t.weight * t.advantage < 0]
    assert len(up) == 6 and len(down) == 6
    assert sum(up) / len(up) > 0.05, up
    assert sum(down) / len(down) < -0.05, down

    m = metrics_of(weighted_run)
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5, 6]
    assert all(r["zero_var_share"] == pytest.approx(0.25) for r in m)  # t2 of 4 groups
    assert all(r["w_mean"] == pytest.approx(W) and r["w_std"] == pytest.approx(0) for r in m)
    # one weight for all: Σ w·A over a group is W·Σ A = 0; every labelled turn was played
    assert all(r["wa_mean"] == pytest.approx(0, abs=1e-6) and r["unplayed_share"] == 0 for r in m)
    # step 1: policy = old = ref
    assert m[0]["clip_frac"] == m[0]["dual_clip_frac"] == 0 and m[0]["kl"] == pytest.approx(0, abs=1e-6)
    assert m[-1]["clip_frac"] > 0 and m[-1]["kl"] > 0
    # engine log-probs are made up, about 6 off the tiny model's ~ -ln(512)
    assert 0 < m[0]["logprob_mismatch"] < 3
    for key in ("loss", "pg_loss", "grad_norm", "reward_mean", "tokens_per_s", "lr", "model_tokens"):
        assert key in m[0]
    # the policy folder is a loadable HF model carrying the tokenizer files of --model; its
    # weights stay float32 (an lr-1e-6 update would vanish in bf16), its config keeps bf16
    assert os.path.isfile(os.path.join(weighted_run, "tokenizer_config.json"))
    assert json.load(open(os.path.join(weighted_run, "config.json")))["dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(os.path.join(weighted_run, "model.safetensors")).values()} == {
        torch.float32
    }
    assert not any(n.startswith(".tmp-") for n in os.listdir(os.path.dirname(weighted_run)))


def test_no_reweight_scales_update_by_w(tiny, data, weighted_run, tmp_path):
    """Step 1 (same mini-batch, ratio 1, zero KL gradient): every token advantage is divided
    by w = 1.6, so the pg loss and the gradient (norm before clipping) are divided by 1.6."""
    out = str(tmp_path / "policy")
    # gradient checkpointing and a separate reference model (here equal to the input policy)
    # must not change the update: they ride along to be exercised
    ok(run_train(tiny, *data, out, *COMMON, "--no-reweight", "--gradient-checkpointing", "--ref-model", tiny))
    plain, weighted = metrics_of(out)[0], metrics_of(weighted_run)[0]
    assert plain["w_mean"] == 1.0
    assert weighted["pg_loss"] == pytest.approx(W * plain["pg_loss"], rel=1e-5)
    assert weighted["grad_norm"] == pytest.approx(W * plain["grad_norm"], rel=1e-4)
    assert abs(plain["pg_loss"]) > 1e-3 and plain["grad_norm"] > 1e-3


def assert_matches_one_process(start, one, two, weights_two=None):
    """A 2-process round (same global mini-batches) took the one-process round's steps: same
    metrics, and weights within 1 % of what the round moved them."""
    m1, m2 = metrics_of(one), metrics_of(two)
    assert len(m1) == len(m2) == 3
    for x, y in zip(m1, m2, strict=True):
        for key in ("loss", "pg_loss", "kl", "grad_norm", "clip_frac", "model_tokens", "logprob_mismatch"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    w1 = load(one).state_dict()
    w2 = weights_two if weights_two is not None else load(two).state_dict()
    moved = distance(w1, load(start).state_dict())
    assert moved > 1e-4 and distance(w1, w2) < 0.01 * moved, (distance(w1, w2), moved)


def test_fsdp_reduce_scatters_every_micro_batch(tiny, data, tmp_path):
    """FSDP2 on 2 CPU processes (tests/fsdp_probe.py): before every micro-batch after the first,
    each parameter's gradient is already its reduce-scattered shard and FSDP holds no unsharded
    gradient (no_sync would keep them all until the last); the mini-batch's gradient equals
    the one-process gradient."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import fsdp_probe

    from common.train.grpo import accumulate_gradients, score_trajectories

    out = str(tmp_path / "probe.pt")
    ok(run_train(tiny, *data, out, launcher=fsdp_launcher(), script=os.path.join(ROOT, "tests", "fsdp_probe.py")))
    probe = torch.load(out)
    for p in probe["processes"]:
        assert p["micro_batches"] >= 2 and len(p["checks"]) == p["micro_batches"] - 1, p
        assert all(c["sharded"] and not c["held"] for c in p["checks"]), p

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(load(tiny))
        trajectories = join_trajectories(read_jsonl(data[0]), read_jsonl(data[1]), {LABEL: W})
        mb = fsdp_probe.plan(trajectories, accelerator)
        score_trajectories(model, mb.mine, "cpu", "old_logprobs")
        for t in (t for micro in mb.mine for t in micro):
            t.ref_logprobs = t.old_logprobs + fsdp_probe.OFFSET
        accumulate_gradients(model, accelerator, mb.mine, mb.norm, kl_coef=fsdp_probe.KL)
        for n, p in model.named_parameters():
            assert (probe["grads"][n] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), n
    finally:
        AcceleratorState._reset_state(True)


def test_fsdp2_bf16_logprobs_stay_float32(tiny, data, tmp_path):
    """The GPU presets' FSDP2 with bf16 mixed precision, on 2 CPU processes (tests/fsdp_bf16_probe.py,
    train_grpo.py's own accelerator): weights are gathered and computed in bf16, and the per-token
    log-probs of the old/reference passes and of the loss come back in float32, equal to a float32
    log-softmax of the bf16 logits, not rounded to bf16 by FSDP2's output cast."""
    out = str(tmp_path / "bf16.json")
    ok(run_train(tiny, *data, out, launcher=fsdp_launcher(), script=os.path.join(ROOT, "tests", "fsdp_bf16_probe.py")))
    found = [x for process in json.load(open(out)) for x in process]
    assert {x["grad"] for x in found} == {False, True}
    assert {(x["dtype"], x["compute_dtype"]) for x in found} == {("torch.float32", "torch.bfloat16")}
    assert max(x["max_diff"] for x in found) <= 1e-5
    assert min(x["bf16_rounding"] for x in found) > 1e-3  # what a bf16 cast would have cost


def test_lora_adapter_trains_saves_and_continues(tiny, data, tmp_path):
    from peft import PeftModel

    out = str(tmp_path / "r0" / "policy")
    ok(
        run_train(
            tiny, *data, out, *COMMON, "--lora", "--lora-r", "4", "--lora-alpha", "8", "--save-optimizer"
        )
    )
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["base_model_name_or_path"] == os.path.abspath(tiny)
    assert os.path.isfile(os.path.join(out, "optimizer", "trainer_state.json"))
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    assert_save_keeps_the_adapter_alone(out)

    ids = torch.tensor([list(range(1, 40))])
    with torch.no_grad():
        base_logits = load(tiny)(ids).logits
        adapted = PeftModel.from_pretrained(load(tiny), out).eval()
        lora_logits = adapted(ids).logits
    assert (lora_logits - base_logits).abs().max() > 1e-4

    # next round: --model is the adapter; training continues it (KL reference = base, adapter off)
    out2 = str(tmp_path / "r1" / "policy")
    proc = ok(run_train(out, *data, out2, *COMMON, "--optimizer-state", os.path.join(out, "optimizer")))
    assert "resuming optimiser state" in proc.stdout
    m = metrics_of(out2)
    assert m[0]["kl"] > 0  # the adapter already moved the policy away from the base
    with torch.no_grad():
        lora2_logits = PeftModel.from_pretrained(load(tiny), out2).eval()(ids).logits
    assert (lora2_logits - lora_logits).abs().max() > 1e-5

    # an adapter's optimiser state does not fit the full model: refused, nothing written
    full = str(tmp_path / "full" / "policy")
    proc = run_train(tiny, *data, full, *COMMON, "--optimizer-state", os.path.join(out, "optimizer"))
    assert proc.returncode != 0 and not os.path.exists(full)
    assert "does not match this model's trainable parameters" in proc.stderr.strip().splitlines()[-1]


def assert_save_keeps_the_adapter_alone(adapter):
    """What a LoRA save gathers (whole_state_dict's trainable_only): the adapter's tensors and no
    base weight, equal to the whole state's, and what the folder holds, bit for bit."""
    from accelerate.state import AcceleratorState

    import train_grpo
    from common.train.distributed import make_accelerator, whole_state_dict

    args = train_grpo.parser.parse_args(["--model", adapter, "--rollouts", "-", "--diagnoses", "-", "--out", "-"])
    AcceleratorState._reset_state(True)
    try:
        accelerator = make_accelerator(cpu=True)
        model = train_grpo.load_policy(args, train_grpo.read_policy(adapter, False), accelerator).model
        kept = whole_state_dict(model, accelerator, trainable_only=True)
        whole = whole_state_dict(model, accelerator)
    finally:
        AcceleratorState._reset_state(True)
    assert kept.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(kept) == 28 and all(".lora_A.default." in k or ".lora_B.default." in k for k in kept)
    assert len(whole) > len(kept) and all(torch.equal(kept[k], whole[k]) for k in kept)
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert saved.keys() == {k.replace(".default.", ".") for k in kept}
    assert all(torch.equal(saved[k.replace(".default.", ".")], v) for k, v in kept.items())


def test_bad_input_stops_without_output(tiny, tmp_path):
    """The command's side of bad input; the messages of each kind are tested in test_grpo.py."""
    rollouts, diagnoses = make_data(str(tmp_path))
    lines = open(rollouts).read().splitlines()
    rec = json.loads(lines[2])
    del rec["tokens"]
    lines[2] = json.dumps(rec)
    open(rollouts, "w").write("\n".join(lines) + "\n")
    out = str(tmp_path / "run" / "policy")
    proc = run_train(tiny, rollouts, diagnoses, out, "--cpu")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"error: {rollouts}:3: missing field(s) tokens"
    assert not os.path.exists(os.path.dirname(out))


def test_adaptive_rho_refusals_and_the_rounds_own_rho(tmp_path):
    """--adaptive-rho beside --rho (a table to use as it is) or --no-reweight (no ρ at all) stops
    at the command line, naming both, with nothing written. Otherwise the join weighs the round
    with its own ρ_t (common/train/grpo.py adaptive_rho), which every metrics line records."""
    import train_grpo
    from common.seal.taxonomy import RHO
    from common.train.grpo import diagnosis_weight

    rollouts, diagnoses = make_data(str(tmp_path))
    rho = tmp_path / "rho.json"
    rho.write_text(json.dumps(RHO))
    out = str(tmp_path / "run" / "policy")
    for extra in (["--rho", str(rho)], ["--no-reweight"]):
        proc = run_train(str(tmp_path / "model"), rollouts, diagnoses, out, "--adaptive-rho", *extra, "--cpu")
        assert proc.returncode == 2 and f"error: --adaptive-rho and {extra[0]}:" in proc.stderr, proc.stderr
    assert not os.path.exists(os.path.dirname(out))

    # t0, t1: failures beside successes (argument_mismatch); t2 fails throughout and t3 once (state_mismatch)
    recs = read_jsonl(diagnoses)
    for d in recs:
        z = "pass" if d["reward"] else "argument_mismatch" if d["task_id"] in ("t0", "t1") else "state_mismatch"
        d |= {"turn_labels": [z], "profile": {z: 1.0}}
    args = SimpleNamespace(rollouts=rollouts, diagnoses=diagnoses, no_reweight=False, adaptive_rho=True)
    trajs, adapted = train_grpo.join(args, read_jsonl(rollouts), recs, RHO)
    assert adapted.kept is None and adapted.learnable == {"argument_mismatch": 1.0, "state_mismatch": 0.2}
    assert adapted.rho["argument_mismatch"] / RHO["argument_mismatch"] > adapted.rho["state_mismatch"] / RHO["state_mismatch"]
    profiles = {(d["task_id"], d["sample_index"]): d["profile"] for d in recs}
    assert [t.weight for t in trajs] == [diagnosis_weight(profiles[t.task_id, t.sample_index], adapted.rho) for t in trajs]
    line = train_grpo.Round(0.25, 1.0, None, 0.0, adapted).recorded()
    assert (line["rho"], line["rho_adapted"], line["rho_learnable"]) == (adapted.rho, True, adapted.learnable)
    assert "rho" not in train_grpo.Round(0.25, 1.0, None, 0.0).recorded()  # seal's lines are as they were
    assert train_grpo.rho_line(adapted).startswith("adaptive ρ (scale ")
    _, none = train_grpo.join(args, read_jsonl(rollouts), read_jsonl(diagnoses), RHO)  # one label: kept
    assert none.kept and train_grpo.rho_line(none) == f"adaptive ρ: kept as the table ({none.kept})"
    assert train_grpo.Round(0.25, 1.0, None, 0.0, none).recorded()["rho_adapted"] is False


def test_temperature_comes_from_the_records(tiny, tmp_path):
    """Old records without it: T = 1 and a warning naming the file; a file mixing
    temperatures: refused with file:line and no output."""
    rollouts, diagnoses = make_data(str(tmp_path / "old"), temperature=None)
    out = str(tmp_path / "old" / "run" / "policy")
    proc = ok(run_train(tiny, rollouts, diagnoses, out, *COMMON, "--mini-batch-tasks", "3"))
    assert f"warning: {rollouts}: 16 of 16 records carry no sampling temperature; read as temperature 1" in proc.stderr
    assert [m["temperature"] for m in metrics_of(out)] == [1.0]

    rollouts, diagnoses = make_data(str(tmp_path / "mixed"), temperature=0.7)
    lines = open(rollouts).read().splitlines()
    rec = json.loads(lines[5])
    rec["sampling"]["temperature"] = 1.0
    lines[5] = json.dumps(rec)
    open(rollouts, "w").write("\n".join(lines) + "\n")
    out = str(tmp_path / "mixed" / "run" / "policy")
    proc = run_train(tiny, rollouts, diagnoses, out, "--cpu")
    assert proc.returncode != 0 and not os.path.exists(os.path.dirname(out))
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {rollouts}:6: temperature 1 differs from 0.7 at {rollouts}:1: one file, one temperature"
    )


def test_logprob_mismatch_vanishes_at_the_sampling_temperature(tiny_model, tmp_path):
    """Real HF-engine rollouts of the tiny model at T = 0.7: the trainer's old log-probs, taken
    at the records' temperature, are the engine's (which are log softmax(logits / 0.7))."""
    from common.engine.engines import make_engine, sampling_params
    from common.envs.bfcl import diagnose as bfcl_diagnose
    from common.envs.bfcl import harness as bfcl
    from common.envs.bfcl import play, tiny
    from common.jsonl import write_jsonl

    task = next(t for t in bfcl.load_tasks(tiny.PRESET_TASKS).values() if t["ground_truth"][0])
    engine = make_engine("hf", tiny_model, max_model_len=16384, seed=0)
    records, _ = play.play([task], 3, engine, play.PlaySpec(temperature=0.7, max_steps_per_turn=1, max_new_tokens=24),
                           progress=False)
    engine.close()
    assert [r["sampling"] for r in records] == [sampling_params(0.7)] * 3  # plain sampling at 0.7
    # real diagnoses, with rewards set so that the group has something to learn on any build
    diagnoses = [bfcl_diagnose.diagnose(task, r) | {"reward": k % 2} for k, r in enumerate(records)]
    write_jsonl(tmp_path / "rollouts.jsonl", records)
    write_jsonl(tmp_path / "diagnoses.jsonl", diagnoses)
    out = str(tmp_path / "policy")
    ok(run_train(tiny_model, str(tmp_path / "rollouts.jsonl"), str(tmp_path / "diagnoses.jsonl"), out, "--cpu"))
    (m,) = metrics_of(out)
    assert m["temperature"] == 0.7 and m["model_tokens"] > 0
    assert m["logprob_mismatch"] < 1e-3, m["logprob_mismatch"]
    # the importance ratio trainer/engine (TRL's importance_sampling_ratio) is then 1
    assert abs(m["is_ratio_mean"] - 1) < 1e-3 and abs(m["is_ratio_max"] - 1) < 1e-2, m


def edit_record(path, line, change):
    """Rewrite line `line` (1-based) of a JSONL file with change(record)."""
    lines = open(path).read().splitlines()
    rec = json.loads(lines[line - 1])
    change(rec)
    lines[line - 1] = json.dumps(rec)
    open(path, "w").write("\n".join(lines) + "\n")


def test_cut_trajectories_leave_the_loss_and_every_step_logs_the_objective(tiny, tmp_path):
    """t0's sample 1 stopped on the context limit. Under a training context (128) shorter than
    evaluation's (the tiny model's own 256) it is cut: out of the loss (its tokens in no token-mean)
    and the round records its share and the stops that cut; --cut keep, or a context as long as
    evaluation's, trains it. Every step logs the policy's entropy and the correction's shares."""
    rollouts, diagnoses = make_data(str(tmp_path / "data"))
    records = read_jsonl(rollouts)
    line = next(r["_line"] for r in records if (r["task_id"], r["sample_index"]) == ("t0", 1))
    edit_record(rollouts, line, lambda r: r.update(stop="context_limit"))
    tokens = sum(sum(r["tokens"]["mask"]) for r in records if r["task_id"] != "t2")  # t2: equal rewards
    cut_tokens = sum(records[line - 1]["tokens"]["mask"])
    one_step = [*COMMON[:2], "--mini-batch-tasks", "4", *COMMON[4:]]
    for name, extra, share, stops, trained in (
        ("cut", ["--max-model-len", "128"], 1 / 16, ["context_limit", "inference_error"], tokens - cut_tokens),
        ("keep", ["--max-model-len", "128", "--cut", "keep"], 0.0, [], tokens),
        ("long", ["--max-model-len", "256", "--rollout-is", "off"], 0.0, ["inference_error"], tokens),
    ):
        out = str(tmp_path / name / "policy")
        ok(run_train(tiny, rollouts, diagnoses, out, *one_step, *extra))
        (m,) = metrics_of(out)
        assert (m["cut_share"], m["cut_stops"], m["model_tokens"]) == (pytest.approx(share), stops, trained), name
        assert 0 < m["entropy"] <= math.log(512) + 1e-4, name  # a distribution over the 512 ids
        assert 0 <= m["rollout_is_frac"] <= m["rollout_is_seq_frac"] <= 1, name
        if "off" in extra:
            assert m["rollout_is_frac"] == m["rollout_is_seq_frac"] == 0


def test_a_model_token_without_an_engine_logprob_is_refused(tiny, tmp_path):
    """The rollout correction needs μ for every model token: a record without one stops the round
    before any model loads, naming its line; --rollout-is off (the paper's objective) trains on it."""
    rollouts, diagnoses = make_data(str(tmp_path))
    edit_record(rollouts, 3, lambda r: r["tokens"]["logprobs"].__setitem__(0, None))  # ids[0] is a model token
    out = str(tmp_path / "run" / "policy")
    proc = run_train(tiny, rollouts, diagnoses, out, *COMMON)
    assert proc.returncode != 0 and not os.path.exists(os.path.dirname(out))
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {rollouts}:3: 1 model token(s) without the engine's log-prob (tokens.logprobs null): the rollout "
        "correction needs them (--rollout-is off trains without it)")
    ok(run_train(tiny, rollouts, diagnoses, out, *COMMON, "--rollout-is", "off"))
    for bad, message in ((["--rollout-is-cap", "1"], "--rollout-is-cap must be above 1"),
                         (["--clip-high", "0"], "--clip-high be positive")):
        proc = run_train(tiny, rollouts, diagnoses, str(tmp_path / "bad" / "policy"), *COMMON, *bad)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# every file in configs/accelerate/ and the kind of run it asks for (a new file must be added here)
ACCEL_CONFIGS = {"fsdp_1gpu": "FSDP", "fsdp_2gpu": "FSDP", "fsdp_4gpu": "FSDP", "fsdp_8gpu": "FSDP", "fsdp_cpu": "FSDP",
                 "ddp_cpu2": "MULTI_GPU"}  # fmt: skip


def test_accelerate_configs_parse(monkeypatch):
    """Accelerate's own loader reads every config file, and under the environment its launcher
    derives from the file, train_grpo.py builds the plugin the file asks for, with its settings."""
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", "accelerate")) if f.endswith(".yaml"))
    assert files == sorted(ACCEL_CONFIGS)
    for name, kind in ACCEL_CONFIGS.items():
        cfg = load_config_from_file(os.path.join(ROOT, "configs", "accelerate", f"{name}.yaml"))
        assert cfg.distributed_type == kind, name
        with monkeypatch.context() as m:
            for k, v in launch_env(name).items():
                m.setenv(k, v)
            plugins = distributed_plugins(cfg.mixed_precision)
        assert list(plugins) == (["fsdp_plugin"] if kind == "FSDP" else []), name
        if kind == "FSDP":
            fsdp, asked = plugins["fsdp_plugin"], cfg.fsdp_config
            assert fsdp.fsdp_version == asked["fsdp_version"] == 2, name
            assert fsdp.reshard_after_forward == asked["fsdp_reshard_after_forward"], name
            assert fsdp.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy", name
            assert fsdp.state_dict_type.name == asked["fsdp_state_dict_type"], name
            # --ref-model is loaded outside FSDP on every rank: rank-0-only loading would leave it empty
            assert fsdp.cpu_ram_efficient_loading is False and asked["fsdp_cpu_ram_efficient_loading"] is False
            assert (fsdp.mixed_precision_policy is None) == (cfg.mixed_precision == "no"), name


def launch_env(name):
    """The environment `accelerate launch --config_file configs/accelerate/<name>.yaml` starts the script in."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    path = os.path.join(ROOT, "configs", "accelerate", f"{name}.yaml")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, SCRIPT]))
    return prepare_multi_gpu_env(args)


def test_gradients_are_reduced_in_float32(monkeypatch):
    """The plugins train_grpo.py hands Accelerate under each 7B config: bf16 compute, float32
    gradient accumulation and reduction (Accelerate's own bf16 policy reduces in bf16)."""
    for name in ("fsdp_4gpu", "ddp_cpu2"):
        with monkeypatch.context() as m:
            for k, v in launch_env(name).items():
                m.setenv(k, v)
            plugins = distributed_plugins("bf16")
        if name == "fsdp_4gpu":
            policy = plugins["fsdp_plugin"].mixed_precision_policy
            assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
            assert policy.output_dtype is None  # the log-probs leave the model in float32
            assert plugins["fsdp_plugin"].fsdp_version == 2
        else:
            assert plugins == {}


def test_bf16_autocast_keeps_float32_gradients(tiny):
    """The DDP (and one-process) path: Accelerate's bf16 autocast computes in bf16, and the
    gradients DDP buckets and all-reduces keep the float32 weights' dtype."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model = accelerator.prepare(load(tiny).train())
        params = [p for p in model.parameters() if p.requires_grad]
        ids = torch.tensor([list(range(1, 30))])
        seen = []
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        accelerator.backward(model(input_ids=ids).logits.float().logsumexp(-1).sum())
        assert seen == [torch.bfloat16]  # the matmuls ran in bf16
        assert {p.grad.dtype for p in params} == {torch.float32}
        assert gradient_dtypes(accelerator, model, params) == {"grad": torch.float32, "reduce": torch.float32}
        with pytest.raises(RuntimeError, match="float32"):
            gradient_dtypes(accelerator, model, [p.to(torch.bfloat16) for p in params])
    finally:
        AcceleratorState._reset_state(True)


def test_zero_variance_keep_and_drop_gradients(tiny, data):
    """keep (verl's loss over every sample): the equal-reward group t2 adds its tokens to the
    token-mean denominator and its KL gradient, and no policy gradient; drop leaves it out.
    So N_keep·g_keep = N_drop·g_drop + N_t2·g_t2, with g_t2 zero without KL."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import train_grpo
    from common.train.grpo import accumulate_gradients, score_trajectories

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(load(tiny))
    trajectories = join_trajectories(read_jsonl(data[0]), read_jsonl(data[1]), {LABEL: W})
    gen = torch.Generator().manual_seed(0)
    for t in trajectories:
        score_trajectories(model, [[t]], "cpu", "old_logprobs")
        t.ref_logprobs = t.old_logprobs + 0.3 * torch.randn(len(t.ids), generator=gen)  # a reference elsewhere

    def plan(mode):
        args = SimpleNamespace(zero_variance=mode, seed=0, mini_batch_tasks=8, max_tokens_per_micro_batch=100)
        (mb,), _ = train_grpo.plan_mini_batches(args, trajectories, accelerator)  # 4 or 3 groups < 8: one mini-batch
        return mb

    def grad(mb, kl_coef):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, accelerator, mb.mine, mb.norm, kl_coef=kl_coef)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    keep, drop = plan("keep"), plan("drop")
    t2 = [t for t in trajectories if t.task_id == "t2"]
    only_t2 = train_grpo.MiniBatch(trajs=t2, mine=[t2], norm=sum(t.model_tokens for t in t2))
    assert {t.task_id for t in keep.trajs} == {"t0", "t1", "t2", "t3"}
    assert {t.task_id for t in drop.trajs} == {"t0", "t1", "t3"}
    assert keep.norm == drop.norm + only_t2.norm
    for kl_coef in (0.0, 0.5):
        g_keep, g_drop, g_t2 = grad(keep, kl_coef), grad(drop, kl_coef), grad(only_t2, kl_coef)
        mixed = (drop.norm * g_drop + only_t2.norm * g_t2) / keep.norm
        assert torch.allclose(g_keep, mixed, rtol=1e-4, atol=1e-7)
        if kl_coef:
            assert g_t2.norm() > 1e-3 * g_drop.norm()  # the KL term pulls t2 towards the reference
        else:
            assert g_t2.abs().max() == 0  # zero advantage, no policy gradient
    AcceleratorState._reset_state(True)


def test_mini_batch_leftovers_and_zero_variance_keep_end_to_end(tiny, data, tmp_path):
    """3 groups with differing rewards at --mini-batch-tasks 2 make one step of 3, not 2 + 1;
    keep trains on all 4 groups, over all their model tokens."""
    rollouts = read_jsonl(data[0])
    tokens = {tid: sum(sum(r["tokens"]["mask"]) for r in rollouts if r["task_id"] == tid) for tid in REWARDS}
    base = [*COMMON[:2], "--mini-batch-tasks", "2", *COMMON[4:], "--epochs", "2"]
    for mode, tids in (("drop", ("t0", "t1", "t3")), ("keep", tuple(REWARDS))):
        out = str(tmp_path / mode / "policy")
        ok(run_train(tiny, *data, out, *base, "--zero-variance", mode))
        m = metrics_of(out)
        assert [r["step"] for r in m] == ([1, 2] if mode == "drop" else [1, 2, 3, 4])
        assert sum(r["model_tokens"] for r in m) == 2 * sum(tokens[t] for t in tids)


# ---------------------------------------------------------------- one optimiser across rounds

# lr 1e-5: the policy moves little in 3 steps, so the PPO ratio of steps 4-6 (old log-probs
# recomputed by round B, the round-0 ones in the single run) is ~1 and the only difference
# left between the runs is whether AdamW's moments and step count carried over
CARRY = ["--lr", "1e-5", *COMMON[2:]]


@pytest.fixture(scope="module")
def carried(tiny, data, tmp_path_factory):
    """One run of 2 epochs (6 steps) against round A (3 steps) + round B (3 steps, same
    rollouts) with the optimiser state carried, and round B with a fresh optimiser."""
    folder = tmp_path_factory.mktemp("carried")
    out = {k: str(folder / k / "policy") for k in ("single", "a", "b", "fresh")}
    ok(run_train(tiny, *data, out["single"], *CARRY, "--epochs", "2"))
    ok(run_train(tiny, *data, out["a"], *CARRY, "--save-optimizer"))
    state = os.path.join(out["a"], "optimizer")
    ok(run_train(out["a"], *data, out["b"], *CARRY, "--ref-model", tiny, "--optimizer-state", state, "--save-optimizer"))
    ok(run_train(out["a"], *data, out["fresh"], *CARRY, "--ref-model", tiny))
    return out


def training_state(policy, tmp):
    """<policy>/optimizer (sharded, torch.distributed.checkpoint) as whole tensors: {"optim":
    {"state": {name: {step, exp_avg, exp_avg_sq}}, "param_groups"}, "model": float32 weights}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, f"state-{len(os.listdir(tmp))}.pt")
    dcp_to_torch_save(os.path.join(policy, "optimizer"), path)
    return torch.load(path, weights_only=False)


def assert_same_state(s1, s2):
    assert s1.keys() == s2.keys() and s1["optim"]["state"].keys() == s2["optim"]["state"].keys()
    for k in s1["optim"]["state"]:
        assert all(torch.equal(s1["optim"]["state"][k][n], s2["optim"]["state"][k][n]) for n in ("step", "exp_avg", "exp_avg_sq"))
    for k in s1.get("model", {}):
        assert torch.equal(s1["model"][k], s2["model"][k]), k


def distance(a, b):
    return math.sqrt(sum(((a[k] - b[k]) ** 2).sum().item() for k in a))


def assert_continues_single_run(single, a, b, fresh=None):
    """Round B's weights are the single run's within 2 % of what steps 4-6 moved them (a
    fresh AdamW restarts its bias correction and lands about half that distance away)."""
    s, a, b = (load(x).state_dict() for x in (single, a, b))
    moved = distance(s, a)
    assert moved > 1e-3
    assert distance(b, s) < 0.02 * moved, (distance(b, s), moved)
    if fresh:
        assert distance(load(fresh).state_dict(), s) > 0.2 * moved


def test_optimizer_state_carries_across_rounds(tiny, carried, tmp_path):
    assert_continues_single_run(carried["single"], carried["a"], carried["b"], carried["fresh"])
    single, a, b = (metrics_of(carried[k]) for k in ("single", "a", "b"))
    assert [(m["step"], m["global_step"]) for m in a + b] == [(1, 1), (2, 2), (3, 3), (1, 4), (2, 5), (3, 6)]
    assert [m["global_step"] for m in metrics_of(carried["fresh"])] == [1, 2, 3]
    # KL to the initial policy in every row: round B's reference is --ref-model, not its input
    assert {m["ref_model"] for m in single + a + b} == {os.path.abspath(tiny)}
    assert b[0]["kl"] == pytest.approx(single[3]["kl"], rel=1e-4) and b[0]["kl"] > 0
    state = training_state(carried["b"], tmp_path)
    assert {float(s["step"]) for s in state["optim"]["state"].values()} == {6.0}
    assert json.load(open(os.path.join(carried["b"], "optimizer", "trainer_state.json"))) == {
        "format": "torch.distributed.checkpoint", "global_step": 6, "master_weights": False, "optimizer": True,
        "world_size": 1, "distributed_type": "NO",
    }  # fmt: skip
    # the policy is float32 on CPU: the optimiser folder holds no second copy of the weights
    assert "model" not in state


# A metrics line's fields, in docs/design.md §3's order: an optimiser step's, and the one line
# of a round with nothing to learn.
STEP_FIELDS = ["step", "global_step", "epoch", "loss", "pg_loss", "kl", "clip_frac", "dual_clip_frac", "entropy",
               "rollout_is_frac", "rollout_is_seq_frac", "grad_norm", "w_mean", "w_std", "wa_mean", "unplayed_share",
               "zero_var_share", "reward_mean", "model_tokens", "tokens_per_s", "seconds", "logprob_mismatch",
               "is_ratio_mean", "is_ratio_max", "objective", "cut_share", "cut_stops", "temperature", "ref_model",
               "logprob_seconds", "lr"]
IDLE_FIELDS = ["step", "global_step", "w_mean", "w_std", "zero_var_share", "reward_mean", "objective", "cut_share",
               "cut_stops", "temperature", "ref_model", "logprob_seconds"]


def test_round_with_nothing_to_learn_writes_its_input_unchanged(tiny, carried, tmp_path):
    """Every group of equal rewards: no step; the input policy and optimiser state are written as
    they were, and one step-0 line records the round's global step, weights and reward."""
    rollouts, diagnoses = make_data(str(tmp_path / "data"), {"t0": [1, 1, 1, 1], "t1": [0, 0, 0, 0]}, seed=1)
    out = str(tmp_path / "run" / "policy")
    state = os.path.join(carried["a"], "optimizer")
    proc = ok(run_train(carried["a"], rollouts, diagnoses, out, *CARRY, "--ref-model", tiny,
                        "--optimizer-state", state, "--save-optimizer"))
    assert "no group has differing rewards: nothing to learn" in proc.stdout
    (m,) = metrics_of(out)
    assert list(m) == [*IDLE_FIELDS, "_line"]  # read_jsonl's
    assert (m["step"], m["global_step"], m["zero_var_share"], m["reward_mean"]) == (0, 3, 1.0, 0.5)
    assert (m["temperature"], m["ref_model"], m["w_std"]) == (1.0, os.path.abspath(tiny), 0.0)
    before, after = load(carried["a"]).state_dict(), load(out).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert_same_state(training_state(carried["a"], tmp_path), training_state(out, tmp_path))
    assert json.load(open(os.path.join(out, "optimizer", "trainer_state.json")))["global_step"] == 3
    # a round that steps writes every field, in order
    assert all(list(m) == [*STEP_FIELDS, "_line"] for m in metrics_of(carried["b"]))


def killed_then_rerun(model, data, out, args, launcher=()):
    """Round B killed as soon as it has loaded its state (its whole process group), a stale
    temporary folder (what a save killed mid-way leaves) beside --out, then the rerun: the
    kill wrote nothing, left the input state as it was, and the rerun removes the stale folder."""
    state = args[args.index("--optimizer-state") + 1]
    before = {f: open(os.path.join(state, f), "rb").read() for f in os.listdir(state)}
    cmd = [*launcher, SCRIPT] if launcher else [sys.executable, SCRIPT]
    cmd += ["--model", model, "--rollouts", data[0], "--diagnoses", data[1], "--out", out, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV | {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, text=True)
    # Reading stdout has no timeout of its own: a launch that stalls before the line (a
    # rendezvous that never completes) would hold the test for ever. The watchdog prints every
    # rank's stack (SIGABRT, PYTHONFAULTHANDLER) and ends it, so the loop below sees EOF.
    watchdog = threading.Timer(LAUNCH_TIMEOUT, kill_tree, (proc.pid, signal.SIGABRT))
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:  # killed as soon as it has loaded the state, before it trains
            lines.append(line)
            if line.startswith("resuming optimiser state"):
                kill_tree(proc.pid)
                break
        else:
            kill_tree(proc.pid)
            pytest.fail(f"{' '.join(cmd)} never loaded its state (stalled or failed):\n{''.join(lines)[-20000:]}")
    finally:
        watchdog.cancel()
    proc.wait(timeout=60)
    assert proc.returncode != 0 and not os.path.exists(out)
    assert {f: open(os.path.join(state, f), "rb").read() for f in os.listdir(state)} == before
    stale = os.path.join(os.path.dirname(out), ".tmp-policy-killed")
    os.makedirs(os.path.join(stale, "optimizer"))
    ok(run_train(model, *data, out, *args, launcher=launcher))
    assert not os.path.exists(stale)


@pytest.fixture(scope="module")
def ddp_rounds(tiny, data, tmp_path_factory):
    """Rounds A and B (B continues A's optimiser) on 2 DDP processes."""
    folder = tmp_path_factory.mktemp("ddp")
    a, b = str(folder / "a" / "policy"), str(folder / "b" / "policy")
    ok(run_train(tiny, *data, a, *CARRY, "--save-optimizer", launcher=ddp_launcher()))
    args = [*CARRY, "--ref-model", tiny, "--optimizer-state", os.path.join(a, "optimizer"), "--save-optimizer"]
    ok(run_train(a, *data, b, *args, launcher=ddp_launcher()))
    return {"a": a, "b": b}


def test_optimizer_state_carries_on_two_processes(tiny, data, carried, ddp_rounds):
    """DDP over 2 CPU processes: round A equals the one-process round A, and round B continues its
    optimiser. (A killed round's rerun is checked on one process and under FSDP2, the GPU presets'
    path: test_killed_round_reruns_to_the_same_weights_and_optimizer_state and
    test_lora_fsdp2_bf16_rounds_as_the_loop_runs_them.)"""
    a, b = ddp_rounds["a"], ddp_rounds["b"]
    assert_matches_one_process(tiny, carried["a"], a)
    assert [m["global_step"] for m in metrics_of(b)] == [4, 5, 6]
    assert_continues_single_run(carried["single"], a, b)
    info = json.load(open(os.path.join(b, "optimizer", "trainer_state.json")))
    assert (info["world_size"], info["distributed_type"], info["master_weights"]) == (2, "MULTI_CPU", False)
    assert sorted(f for f in os.listdir(os.path.join(b, "optimizer")) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip


def test_two_machines_match_one(tiny, data, ddp_rounds, tmp_path):
    """Two machine ranks on this host (two `accelerate launch --num_machines 2` of one process
    each, as common/train/launch.py builds them for a SLURM allocation) train as one machine with two
    processes does."""
    from common.train.launch import accelerate_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    config = os.path.join(ROOT, "configs", "accelerate", "ddp_cpu2.yaml")
    out = str(tmp_path / "policy")
    cmd = [SCRIPT, "--model", tiny, "--rollouts", data[0], "--diagnoses", data[1], "--out", out, *CARRY, "--save-optimizer"]
    machines = [
        subprocess.Popen([*accelerate_command(accelerate, 2, config, 2, "127.0.0.1", port), "--machine_rank", str(r), *cmd],
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        logs = [m.communicate(timeout=LAUNCH_TIMEOUT)[0] for m in machines]
    finally:
        for m in machines:
            kill_tree(m.pid)
    assert [m.returncode for m in machines] == [0, 0], "\n".join(logs)
    ref, new = load(ddp_rounds["a"]).state_dict(), load(out).state_dict()
    assert all(torch.equal(ref[k], new[k]) for k in ref)
    assert [m["loss"] for m in metrics_of(out)] == [m["loss"] for m in metrics_of(ddp_rounds["a"])]


def test_killed_round_reruns_to_the_same_weights_and_optimizer_state(tiny, data, carried, tmp_path):
    """Round B killed mid-way leaves no output and its input state untouched; the rerun
    gives the uninterrupted round B's weights and optimiser state."""
    state = os.path.join(carried["a"], "optimizer")
    out = str(tmp_path / "b" / "policy")
    killed_then_rerun(carried["a"], data, out, [*CARRY, "--ref-model", tiny, "--optimizer-state", state, "--save-optimizer"])
    ref, new = load(carried["b"]).state_dict(), load(out).state_dict()
    assert all(torch.equal(ref[k], new[k]) for k in ref)
    assert_same_state(training_state(carried["b"], tmp_path), training_state(out, tmp_path))
    assert [m["global_step"] for m in metrics_of(out)] == [4, 5, 6]


def test_bf16_policy_resumes_from_the_float32_master(tiny, data, carried, tmp_path):
    """--policy-dtype bfloat16 (the GPU presets' default): the policy folder is bf16, the state
    folder holds the float32 master weights, and round B continues from those, not from the
    rounded policy: it ends bit-identical to round B after a float32 round A."""
    a, b = str(tmp_path / "a" / "policy"), str(tmp_path / "b" / "policy")
    ok(run_train(tiny, *data, a, *CARRY, "--save-optimizer", "--policy-dtype", "bfloat16"))
    weights = load_file(os.path.join(a, "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    state = training_state(a, tmp_path)
    fp32 = load(carried["a"]).state_dict()
    assert all(torch.equal(state["model"][k], fp32[k]) for k in state["model"])
    assert any(not torch.equal(weights[k].float(), fp32[k]) for k in weights)  # rounding the policy matters
    args = [*CARRY, "--ref-model", tiny, "--optimizer-state", os.path.join(a, "optimizer"), "--save-optimizer"]
    proc = ok(run_train(a, *data, b, *args))
    assert "resuming optimiser state and float32 master weights" in proc.stdout
    ref, new = load(carried["b"]).state_dict(), load(b).state_dict()
    assert all(torch.equal(ref[k], new[k]) for k in ref)


def test_fsdp2_rounds_as_the_loop_runs_them(tiny_model, data, tmp_path):
    """`bash loop.sh tiny --set NPROC=2 --set ACCEL_CONFIG=configs/accelerate/fsdp_cpu.yaml`'s
    train stage: FSDP2 on 2 CPU processes (gradients reduce-scattered every micro-batch, in
    float32), on the loop's own model (whose tokenizer spells the weights probe, so the probe's
    forward runs before the save, as in every full fine-tuning round), with loop.sh's flags
    (--ref-model, --save-optimizer, then --optimizer-state). Round A saves a bf16 policy, as the
    GPU presets do, so each process writes its shard of the float32 master weights and AdamW's
    moments; round B continues from them and the global step, as a float32 policy, as the loop
    on CPU does (its state AdamW's alone). Round A takes the one-process round's steps; one
    process continues the 2-process state (DCP reshards) with round B's steps. (A killed round
    B under FSDP2: test_lora_fsdp2_bf16_rounds_as_the_loop_runs_them.)"""
    out = {k: str(tmp_path / k / "policy") for k in ("one_a", "a", "b", "one")}
    first = [*CARRY, "--ref-model", tiny_model, "--save-optimizer"]
    ok(run_train(tiny_model, *data, out["one_a"], *CARRY, "--ref-model", tiny_model))
    proc = ok(run_train(tiny_model, *data, out["a"], *first, "--policy-dtype", "bfloat16", launcher=fsdp_launcher()))
    assert "gradients accumulated in torch.float32, reduced in torch.float32" in proc.stdout
    info = json.load(open(os.path.join(out["a"], "optimizer", "trainer_state.json")))
    assert info == {"format": "torch.distributed.checkpoint", "global_step": 3, "master_weights": True,
                    "optimizer": True, "world_size": 2, "distributed_type": "FSDP"}  # fmt: skip
    assert sorted(f for f in os.listdir(os.path.join(out["a"], "optimizer")) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # fmt: skip
    assert_matches_one_process(tiny_model, out["one_a"], out["a"], training_state(out["a"], tmp_path)["model"])
    state = os.path.join(out["a"], "optimizer")
    args = [*first, "--optimizer-state", state]
    proc = ok(run_train(out["a"], *data, out["b"], *args, launcher=fsdp_launcher()))
    assert f"resuming optimiser state and float32 master weights from {state} (global step 3)" in proc.stdout
    assert [m["global_step"] for m in metrics_of(out["b"])] == [4, 5, 6]
    info = json.load(open(os.path.join(out["b"], "optimizer", "trainer_state.json")))
    assert (info["global_step"], info["master_weights"]) == (6, False)
    assert all(os.path.isfile(os.path.join(out[k], "probe.json")) for k in ("a", "b"))  # the probe ran
    # what a server check reads besides: every saved tensor's sha256, the previous policy's of those
    # the round changed, and the probe of the weights the round started from where they are --model's
    # own (round A's; round B starts from the float32 master weights, not the folder's bf16 ones)
    pa, pb = (json.load(open(os.path.join(out[k], serve.PROBE))) for k in ("a", "b"))
    assert pa["sha256"] == serve.file_digests(out["a"]) and pb["sha256"] == serve.file_digests(out["b"])
    before = serve.file_digests(tiny_model)
    assert pa["previous"] and all(before[k] == v != pa["sha256"][k] for k, v in pa["previous"].items())
    assert pb["previous"] and all(pa["sha256"][k] == v != pb["sha256"][k] for k, v in pb["previous"].items())
    assert pa["start"]["model"] == os.path.abspath(tiny_model) and pb["start"]["model"] == os.path.abspath(out["a"])
    assert len(pa["start"]["logprobs"]) == len(pa["ids"]) - 1 and "logprobs" not in pb["start"]
    # one process continues the 2-process state: the same round within float tolerance
    proc = ok(run_train(out["a"], *data, out["one"], *args))
    assert "resuming optimiser state and float32 master weights" in proc.stdout
    ref, one = load(out["b"]).state_dict(), load(out["one"]).state_dict()
    assert all(torch.allclose(ref[k], one[k], atol=1e-6) for k in ref)
    assert [m["global_step"] for m in metrics_of(out["one"])] == [4, 5, 6]
    assert_matches_one_process(out["one_a"], out["one"], out["b"])


def test_lora_fsdp2_bf16_rounds_as_the_loop_runs_them(tiny, data, tmp_path):
    """The GPU presets' LoRA round on 2 CPU processes: FSDP2 with bf16 mixed precision (the
    launch's `--mixed_precision bf16`, which train_grpo.py honours on CPU), a bf16 base with tied
    embeddings, loop.sh's flags (--lora, --ref-model, --save-optimizer, then the adapter as
    --model and --optimizer-state). The base stays frozen in bf16 and the adapter float32; round
    B, killed once as soon as it has loaded its state (no output, its input untouched) and rerun,
    continues round A's adapter, AdamW's moments and global step, its KL taken against the base
    (the adapter disabled); each save holds the adapter's float32 weights alone, and they moved."""
    from peft import PeftModel

    base = str(tmp_path / "base")
    load(tiny).to(torch.bfloat16).save_pretrained(base)
    a, b = str(tmp_path / "a" / "policy"), str(tmp_path / "b" / "policy")
    launcher = [*fsdp_launcher(), "--mixed_precision", "bf16"]
    flags = [*COMMON, "--lora", "--lora-r", "4", "--lora-alpha", "8", "--ref-model", base, "--save-optimizer"]
    proc = ok(run_train(base, *data, a, *flags, launcher=launcher))
    assert "adapter in ['torch.float32'], frozen base in ['torch.bfloat16']" in proc.stdout
    assert "gradients accumulated in torch.float32, reduced in torch.float32" in proc.stdout
    killed_then_rerun(a, data, b, [*flags, "--optimizer-state", os.path.join(a, "optimizer")], launcher=launcher)
    m = metrics_of(b)
    assert [r["global_step"] for r in m] == [4, 5, 6] and m[0]["kl"] > 0
    info = json.load(open(os.path.join(b, "optimizer", "trainer_state.json")))
    assert (info["global_step"], info["master_weights"], info["world_size"], info["distributed_type"]) == (
        6, False, 2, "FSDP")  # fmt: skip
    assert {float(s["step"]) for s in training_state(b, tmp_path)["optim"]["state"].values()} == {6.0}
    # 2 layers x 7 linear modules x (A, B); no base weight (none of the tied embedding) gathered into them
    wa, wb = (load_file(os.path.join(p, "adapter_model.safetensors")) for p in (a, b))
    assert wa.keys() == wb.keys() and len(wa) == 28 and all(".lora_A." in k or ".lora_B." in k for k in wa)
    assert {v.dtype for v in (*wa.values(), *wb.values())} == {torch.float32}
    assert all(wa[k].abs().max() > 0 for k in wa if ".lora_B." in k)  # B starts at zero: round A moved it
    assert all(not torch.equal(wa[k], wb[k]) for k in wa)  # round B moved every adapter weight
    assert not os.path.exists(os.path.join(b, "model.safetensors"))
    ids = torch.tensor([list(range(1, 40))])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(load(base), b).eval()(ids).logits
        assert (adapted - load(base)(ids).logits).abs().max() > 1e-4


def test_state_from_another_format_is_refused(tiny, data, tmp_path):
    """An optimiser folder in Accelerate's old save_state format (or half copied) names the
    folder, exits non-zero and writes nothing."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "trainer_state.json").write_text('{"global_step": 3}')
    (old / "optimizer.bin").write_bytes(b"")
    out = str(tmp_path / "run" / "policy")
    proc = run_train(tiny, *data, out, *CARRY, "--optimizer-state", str(old))
    assert proc.returncode != 0 and not os.path.exists(os.path.dirname(out))
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {old}: optimiser state in the format Accelerate's")
    (old / "trainer_state.json").write_text(json.dumps({
        "format": "torch.distributed.checkpoint", "global_step": 3, "master_weights": True, "optimizer": True,
    }))  # fmt: skip
    proc = run_train(tiny, *data, out, *CARRY, "--optimizer-state", str(old))
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {old}: trainer_state.json but no .metadata: an incomplete torch.distributed.checkpoint folder"
    )
