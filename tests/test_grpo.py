"""The numbers of common/train/grpo.py on hand-computed examples: group advantages (population std,
zero-variance groups), the SEAL weight and its clip, the clipped surrogate, the k3 KL, the
logits-to-token shift, loss masking (checked through gradients), the chunked log-probs
against the full-logits computation (values and gradients), token-mean normalisation,
micro-batch planning, the join of rollouts with diagnoses, and the adaptive ρ's invariants
(seal-adaptive) on synthetic diagnoses. The objective beyond the paper's: clip-higher, Dr. GRPO's
advantages and GSPO's ratio on a two-token two-trajectory example, the entropy of the chunked pass,
the rollout correction against engine log-probs equal to the trainer's and shifted, and cut
trajectories out of their group's statistics.
"""

import json
import math
import random

import pytest
import torch

from common.jsonl import RecordError, read_jsonl
from common.seal.taxonomy import LABELS, RHO
from common.train.grpo import (
    ADV_EPS,
    ROLLOUT_IS,
    accumulate_gradients,
    adaptive_rho,
    clipped_surrogate,
    collate,
    diagnosis_weight,
    group_advantages,
    join_round,
    join_trajectories,
    kl_k3,
    load_rho,
    mini_batch_slices,
    plan_micro_batches,
    rollout_correction,
    rollout_temperature,
    score_trajectories,
    sequence_logprobs,
    token_logprobs,
    token_loss,
)

# ---------------------------------------------------------------- advantages


def test_group_advantages_population_std():
    adv, zero = group_advantages(["a"] * 4 + ["b"] * 4, [1, 0, 0, 1, 0, 0, 0, 1])
    # a: mean 0.5, std 0.5
    assert adv[:4] == pytest.approx([x * 0.5 / (0.5 + ADV_EPS) for x in (1, -1, -1, 1)], rel=1e-9)
    # b: mean 0.25, population std sqrt(3/16) = 0.4330 (the unbiased one, 0.5, would give 1.5 and -0.5)
    std = math.sqrt(3 / 16)
    assert adv[7] == pytest.approx(0.75 / (std + ADV_EPS)) and adv[7] == pytest.approx(1.7320508, rel=1e-5)
    assert adv[4] == pytest.approx(-0.25 / (std + ADV_EPS)) and adv[4] == pytest.approx(-0.5773503, rel=1e-5)
    assert sum(adv[4:]) == pytest.approx(0, abs=1e-9)
    assert zero == []


def test_zero_variance_groups_give_zero_advantage():
    adv, zero = group_advantages(["a", "a", "b", "b", "c", "c", "d"], [1, 1, 0, 0, 0, 1, 1])
    assert adv[:4] == [0.0] * 4 and adv[6] == 0.0  # all-solved, all-failed, single sample
    assert sorted(zero) == ["a", "b", "d"]
    assert adv[4] == pytest.approx(-1, rel=1e-5) and adv[5] == pytest.approx(1, rel=1e-5)


# ---------------------------------------------------------------- SEAL weight


def test_default_rho_is_what_the_weight_applies():
    """A trajectory whose turns all carry one label gets that label's default ρ as its weight (no
    default lies outside the clip), a passing one keeps GRPO's advantage (w = 1), and every failure
    SEAL pushes on (a failed call, a wrong argument, a missed call, a failed recovery) outweighs a pass."""
    for z, rho in RHO.items():
        assert diagnosis_weight({z: 1.0}, RHO) == rho, z
    assert RHO["pass"] == 1.0
    for z in ("invalid_tool_call", "argument_mismatch", "missing_tool_call", "recovery_failure"):
        assert RHO[z] > RHO["pass"], z


def test_diagnosis_weight_mix_and_clip():
    # 0.5·1.0 + 0.25·2.0 + 0.25·1.5 = 1.375
    assert diagnosis_weight({"pass": 0.5, "invalid_tool_call": 0.25, "missing_tool_call": 0.25}, RHO) == 1.375
    assert diagnosis_weight({"response_mismatch": 1.0}, RHO) == pytest.approx(0.9)
    assert diagnosis_weight({"invalid_tool_call": 1.0}, RHO) == 2.0  # exactly on the upper bound
    rho = {"big": 3.0, "small": 0.2, "mid": 1.0}
    assert diagnosis_weight({"big": 1.0}, rho) == 2.0  # 3.0 clipped down
    assert diagnosis_weight({"big": 0.5, "mid": 0.5}, rho) == 2.0  # 2.0 stays
    assert diagnosis_weight({"big": 0.4, "mid": 0.6}, rho) == pytest.approx(1.8)
    assert diagnosis_weight({"small": 1.0}, rho) == 0.5  # 0.2 clipped up
    assert diagnosis_weight({"small": 0.5, "mid": 0.5}, rho) == pytest.approx(0.6)
    with pytest.raises(KeyError, match="unknown label"):
        diagnosis_weight({"pass": 0.5, "made_up": 0.5}, RHO)


def test_load_rho(tmp_path):
    custom = {"pass": 1.0, "invalid_tool_call": 3.0}
    (tmp_path / "with.json").write_text(json.dumps({"version": 1, "rho": custom}))
    (tmp_path / "without.json").write_text(json.dumps({"version": 1}))
    (tmp_path / "rho.json").write_text(json.dumps(custom))
    (tmp_path / "bad.json").write_text(json.dumps({"pass": "high"}))
    assert load_rho(str(tmp_path / "with.json")) == custom
    assert load_rho(str(tmp_path / "without.json")) == RHO
    assert load_rho(rho_path=str(tmp_path / "rho.json")) == custom
    assert load_rho() == RHO
    with pytest.raises(RecordError, match=r"bad\.json: ρ must be"):
        load_rho(rho_path=str(tmp_path / "bad.json"))
    with pytest.raises(RecordError, match="no such file"):
        load_rho(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- adaptive ρ (seal-adaptive)

FAILURES = LABELS[2:]  # after pass and correct_abstention


def cohort(groups):
    """Diagnosis records from {task: [(reward, {label: fraction}), ...]}."""
    return [{"task_id": tid, "sample_index": k, "reward": r, "profile": p}
            for tid, samples in groups.items() for k, (r, p) in enumerate(samples)]


def live_mean_weight(diagnoses, rho):
    adv, _ = group_advantages([d["task_id"] for d in diagnoses], [d["reward"] for d in diagnoses])
    ws = [diagnosis_weight(d["profile"], rho) for d, a in zip(diagnoses, adv, strict=True) if a != 0]
    return sum(ws) / len(ws)


def random_cohort(rng):
    """8 tasks x 4 samples: random rewards, each failure a random mix of up to 3 labels beside
    passes; heavy on invalid_tool_call now and then, so the weight's clip at 2 bites."""
    groups = {}
    for t in range(8):
        samples = []
        for _ in range(4):
            if rng.random() < 0.35:
                samples.append((1, {"pass": 1.0}))
                continue
            zs = rng.sample(FAILURES, rng.randint(1, 3)) + (["invalid_tool_call"] * 3 if rng.random() < 0.2 else [])
            turns = zs + ["pass"] * rng.randint(0, 2)
            samples.append((0, {z: turns.count(z) / len(turns) for z in set(turns)}))
        groups[f"t{t}"] = samples
    return cohort(groups)


def test_adaptive_rho_stays_in_its_band_and_keeps_the_mean_weight():
    """ρ_t is finite and within [ρ/2, 2ρ] for every label (the good outcomes' and unseen labels'
    exactly ρ), and the mean weight over the trajectories with A ≠ 0 is the table's: the mode
    moves where the learning rate goes, not how much of it there is."""
    rng, moved = random.Random(0), 0
    for _ in range(100):
        diagnoses = random_cohort(rng)
        a = adaptive_rho(RHO, diagnoses)
        assert set(a.rho) == set(RHO) and 1.0 <= a.scale <= 2.0
        for z, v in a.rho.items():
            assert math.isfinite(v) and RHO[z] / 2 - 1e-12 <= v <= 2 * RHO[z] + 1e-12, (z, v)
            if z not in a.learnable:
                assert v == RHO[z]
        assert live_mean_weight(diagnoses, a.rho) == pytest.approx(live_mean_weight(diagnoses, RHO), rel=1e-9)
        moved += a.kept is None
    assert moved > 75  # the rule moved ρ in most cohorts, not only kept it


def test_adaptive_rho_favours_failures_that_sit_beside_successes():
    """argument_mismatch fails only in groups that also succeed (s = 1), state_mismatch half in
    such groups and half in an all-fail one (s = 1/2), response_mismatch only where every sample
    fails (s = 0): relative to the table, ρ_t gives them c, 3c/4 and c/2."""
    fail = lambda z: (0, {z: 0.5, "pass": 0.5})  # noqa: E731
    diagnoses = cohort({
        "mixed1": [(1, {"pass": 1.0}), fail("argument_mismatch"), fail("state_mismatch"), fail("argument_mismatch")],
        "mixed2": [(1, {"pass": 1.0}), (1, {"pass": 1.0}), fail("argument_mismatch"), (1, {"pass": 1.0})],
        "flat": [fail("state_mismatch"), fail("response_mismatch"), fail("response_mismatch"), fail("response_mismatch")],
    })
    a = adaptive_rho(RHO, diagnoses)
    assert a.kept is None and a.learnable == {"argument_mismatch": 1.0, "state_mismatch": 0.5, "response_mismatch": 0.0}
    ratio = {z: a.rho[z] / RHO[z] for z in a.learnable}
    assert ratio["argument_mismatch"] == pytest.approx(a.scale)
    assert ratio["state_mismatch"] == pytest.approx(0.75 * a.scale)
    assert ratio["response_mismatch"] == pytest.approx(0.5 * a.scale)
    assert a.rho["pass"] == RHO["pass"] and a.rho["invalid_tool_call"] == RHO["invalid_tool_call"]  # unseen
    assert live_mean_weight(diagnoses, a.rho) == pytest.approx(live_mean_weight(diagnoses, RHO), rel=1e-9)


def test_adaptive_rho_with_one_failure_label_or_none_is_the_table(tmp_path):
    """A single failure label has nothing to move weight between: the weights are seal's. A round
    without any failure keeps ρ too; each says why."""
    one = cohort({"a": [(1, {"pass": 1.0}), (0, {"missing_tool_call": 1.0}), (0, {"missing_tool_call": 0.5, "pass": 0.5})],
                  "b": [(0, {"missing_tool_call": 1.0})] * 3})
    a = adaptive_rho(RHO, one)
    assert a.rho == RHO and a.kept == "fewer than two failure labels in groups with differing rewards"
    none = adaptive_rho(RHO, cohort({"a": [(1, {"pass": 1.0}), (0, {"correct_abstention": 1.0})]}))
    assert none.rho == RHO and none.learnable == {} and none.kept == "no failure in the round's diagnoses"
    rollouts = [rollout(d["task_id"], d["sample_index"]) for d in one]
    rp, dp = write(tmp_path / "r.jsonl", rollouts), write(tmp_path / "d.jsonl", one)
    seal = join_trajectories(read_jsonl(rp), read_jsonl(dp), RHO)
    adaptive, adapted = join_round(read_jsonl(rp), read_jsonl(dp), RHO, adaptive=True)
    assert adapted.kept and [t.weight for t in adaptive] == [t.weight for t in seal]
    assert join_round(read_jsonl(rp), read_jsonl(dp), RHO)[1] is None  # seal: no adaptive record


# ---------------------------------------------------------------- per-token loss


@pytest.mark.parametrize(
    "ratio, adv, loss, clipped, grad",
    [
        (1.5, 1.0, -1.2, True, 0.0),  # A > 0, ratio above 1 + c: capped, no gradient
        (0.5, 1.0, -0.5, False, -0.5),  # A > 0, ratio below 1 - c: unclipped (pessimistic min)
        (0.5, -1.0, 0.8, True, 0.0),  # A < 0, ratio below 1 - c: capped, no gradient
        (1.5, -1.0, 1.5, False, 1.5),  # A < 0, ratio above 1 + c: unclipped
        (1.1, 2.0, -2.2, False, -2.2),  # inside the band
    ],
)
def test_clipped_surrogate(ratio, adv, loss, clipped, grad):
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    value, was_clipped, dual = clipped_surrogate(logp, torch.zeros(1), torch.tensor([adv]), clip=0.2)
    value.sum().backward()
    assert value.item() == pytest.approx(loss, rel=1e-6)
    assert was_clipped.item() is clipped and not dual.item()  # ratios below the dual clip's 3
    # d/dlogp of -A·ratio is -A·ratio
    assert logp.grad.item() == pytest.approx(grad, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize(
    "ratio, adv, c, loss, dual, grad",
    [
        # verl: A < 0 -> min(max(-A·r, -A·clip(r)), -A·c)
        (4.0, -1.0, 3.0, 3.0, True, 0.0),  # max(4, 1.2) = 4 > 3: capped at -A·c, no gradient
        (4.0, -1.0, 0.0, 4.0, False, 4.0),  # c = 0: off, the plain PPO loss and gradient -A·r
        (2.5, -2.0, 3.0, 5.0, False, 5.0),  # max(5, 2.4) = 5 < 6: below the cap
        (4.0, -1.0, 5.0, 4.0, False, 4.0),  # a looser cap
        (4.0, 1.0, 3.0, -1.2, False, 0.0),  # A > 0: only PPO's clip (1 + 0.2)
        (0.1, -1.0, 3.0, 0.8, False, 0.0),  # A < 0, ratio below 1 - c: PPO's clip, far from the cap
    ],
)
def test_dual_clip(ratio, adv, c, loss, dual, grad):
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    value, _, was_dual = clipped_surrogate(
        logp, torch.zeros(1), torch.tensor([adv]), clip=0.2, clip_ratio_c=c
    )
    value.sum().backward()
    assert value.item() == pytest.approx(loss, rel=1e-6)
    assert was_dual.item() is dual
    assert logp.grad.item() == pytest.approx(grad, rel=1e-6, abs=1e-12)


def test_token_loss_counts_both_clips():
    # ratios 4, 1.5, 1 on A = -1, then 1.5 on A = +1; the last position is masked out
    logp = torch.tensor([[math.log(4.0), math.log(1.5), 0.0, math.log(1.5), math.log(4.0)]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    zeros = torch.zeros_like(logp)
    loss, stats = token_loss(logp, zeros, zeros, adv, mask, norm=4, clip=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 1.5 + 1.0 - 1.2) / 4)
    assert (stats["clip_count"], stats["dual_clip_count"], stats["tokens"]) == (1, 1, 4)


def test_kl_k3_value_and_gradient():
    new = torch.tensor([math.log(0.5), math.log(0.3), -100.0], requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.3), math.log(0.9)])
    k = kl_k3(new, ref)
    # d = ref - new = ln 0.5: exp(d) - d - 1 = 0.5 + ln 2 - 1
    assert k[0].item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    assert k[1].item() == 0.0
    assert k[2].item() == 10.0  # a token the policy has all but ruled out: bounded
    k.sum().backward()
    # d k3 / d new = 1 - exp(ref - new): 0.5 above, 0 where the policies agree or at the bound
    assert new.grad.tolist() == pytest.approx([0.5, 0.0, 0.0], abs=1e-7)


def test_token_loss_is_token_mean_across_sequences():
    """Two sequences with 1 and 3 model tokens: the loss is the mean over the 4 tokens, not
    the mean of the two per-sequence means."""
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([[4.0, 4.0, 4.0], [1.0, 1.0, 1.0]])
    zeros = torch.zeros(2, 3)
    loss, stats = token_loss(zeros, zeros, zeros, adv, mask, norm=4, clip=0.2, kl_coef=0.0)
    assert loss.item() == pytest.approx(-(4 + 1 + 1 + 1) / 4)  # not -(4 + 1) / 2
    assert stats["tokens"] == 4 and stats["pg_sum"] == pytest.approx(-7)
    # split in micro-batches normalised by the mini-batch count, the pieces add up to the same
    a, _ = token_loss(zeros[:1], zeros[:1], zeros[:1], adv[:1], mask[:1], norm=4)
    b, _ = token_loss(zeros[1:], zeros[1:], zeros[1:], adv[1:], mask[1:], norm=4)
    assert (a + b).item() == pytest.approx(loss.item())


def test_token_loss_ignores_non_finite_values_at_masked_positions():
    mask = torch.tensor([[True, False]])
    logp = torch.tensor([[0.0, float("inf")]], requires_grad=True)
    loss, _ = token_loss(
        logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mask, norm=1, kl_coef=0.1
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0


# ---------------------------------------------------------------- token alignment and masking


def test_token_logprobs_against_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    expect = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, targets), expect, atol=1e-6)
    # the bf16 path upcasts per sequence and agrees up to bf16 rounding of the logits
    assert torch.allclose(token_logprobs(logits.bfloat16(), targets), expect, atol=0.05)


def traj(prompt, ids, mask, adv=1.0, weight=1.0):
    from common.train.grpo import TrainingSequence

    return TrainingSequence("t", 0, prompt, ids, mask, [None] * len(ids), 1.0, weight, adv)


def small_qwen(vocab=64, tie=False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg)


def test_shift_and_mask_through_gradients():
    """Loss flows only from the hidden state at position P+i-1 for each model token ids[i]
    (mask 1) into the output layer: prompt, cue/tool-response tokens (mask 0) and padding
    send exactly zero gradient (they are not even projected onto the vocabulary)."""
    a = traj([5, 6, 7], [1, 2, 3, 4, 8], [1, 0, 0, 1, 1])  # P = 3
    b = traj([5, 6], [9, 3], [1, 1])  # P = 2, shorter: right-padded
    batch = collate([a, b], "cpu")
    T = batch["input_ids"].shape[1]
    assert T == 8 and batch["off"] == 2
    model = small_qwen()
    grads = []

    def keep_grad(module, args, out):
        out.register_hook(grads.append)

    model.model.norm.register_forward_hook(keep_grad)
    logp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["off"], mask=batch["mask"])
    assert logp.shape == (2, T - 2) and (logp[~batch["mask"]] == 0).all()
    loss, _ = token_loss(logp, batch["old"], batch["ref"], batch["adv"], batch["mask"], norm=5)
    loss.backward()
    (grad,) = grads
    touched = {(r, p) for r, p in (grad.abs().sum(-1) > 0).nonzero().tolist()}
    # row a: model tokens ids[0], ids[3], ids[4] sit at positions 3, 6, 7 -> hidden states 2, 5, 6
    # row b: ids[0], ids[1] at positions 2, 3 -> hidden states 1, 2
    assert touched == {(0, 2), (0, 5), (0, 6), (1, 1), (1, 2)}


def full_logits_logprobs(model, batch, temperature):
    """What sequence_logprobs computed before it was chunked: the whole (B, T - off, V) logits
    block in one piece, then log-softmax and gather (the reference for the chunked path)."""
    T, off = batch["input_ids"].shape[1], batch["off"]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=T - off + 1)
    logits = out.logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, off:, None])[..., 0]


CHUNK_TRAJS = [
    traj([3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [1, 1, 0, 0, 1, 1, 1]),
    traj([10, 11], [12, 13, 14, 15, 16, 17], [1, 1, 0, 0, 1, 0]),
    traj([20, 21, 22], [23, 24], [0, 1]),
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_logprobs_match_full_logits(temperature, chunk, tie):
    """Chunks of 1, 3 (ragged) and all positions: the values of the full-logits computation
    (1e-5, float32) at model tokens, and the same gradient in every weight."""
    batch = collate(CHUNK_TRAJS, "cpu")
    mask = batch["mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    model = small_qwen(tie=tie)

    def run(fn):
        model.zero_grad(set_to_none=True)
        lp = fn()
        torch.where(mask, lp * weights, 0.0).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp, grads = run(lambda: sequence_logprobs(
        model, batch["input_ids"], batch["attention_mask"], batch["off"], temperature, mask, chunk=chunk))
    ref, ref_grads = run(lambda: full_logits_logprobs(model, batch, temperature))
    assert torch.allclose(lp[mask], ref[mask], atol=1e-5)
    assert (lp[~mask] == 0).all()
    for n, g in ref_grads.items():  # float rounding apart (sums in another order)
        assert (grads[n] - g).abs().max() <= 1e-5 * g.abs().max(), n


def test_chunked_logprobs_hold_no_logits_for_backward():
    """Nothing of vocabulary size is kept from forward to backward (each chunk's logits are
    recomputed there); the full-logits computation keeps the whole block. The vocabulary
    (97) is a size no other tensor of the model has."""
    batch = collate(CHUNK_TRAJS, "cpu")
    model = small_qwen(vocab=97)

    def saved_shapes(fn):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return shapes

    chunked = saved_shapes(lambda: sequence_logprobs(
        model, batch["input_ids"], batch["attention_mask"], batch["off"], 1.0, batch["mask"], chunk=3))
    full = saved_shapes(lambda: full_logits_logprobs(model, batch, 1.0))
    assert any(97 in s and len(s) == 3 for s in full)
    assert not any(97 in s and math.prod(s) > 97 * 32 for s in chunked), chunked  # at most the head's weight


def test_chunked_logprobs_without_model_tokens_and_through_lora():
    """A micro-batch without model tokens still reaches every weight (zeros: DDP waits for
    every gradient); a PEFT-wrapped model projects through its base's output layer."""
    from peft import LoraConfig, get_peft_model

    batch = collate(CHUNK_TRAJS, "cpu")
    model = small_qwen()
    none = torch.zeros_like(batch["mask"])
    lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["off"], mask=none)
    lp.sum().backward()
    assert (lp == 0).all()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.parameters())

    peft = get_peft_model(small_qwen(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        lp = sequence_logprobs(peft, batch["input_ids"], batch["attention_mask"], batch["off"], 0.7, batch["mask"])
        ref = full_logits_logprobs(peft, batch, 0.7)
    assert torch.allclose(lp[batch["mask"]], ref[batch["mask"]], atol=1e-5)


def test_sequence_logprobs_matches_unpadded_full_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    trajs = [traj([3, 4, 5, 6], [7, 8, 9], [1, 0, 1]), traj([10, 11], [12, 13, 14, 15, 16], [1, 1, 0, 0, 1])]
    batch = collate(trajs, "cpu")
    with torch.no_grad():
        lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["off"])
        for row, t in zip(lp, trajs, strict=True):
            seq = torch.tensor([t.prompt_ids + t.ids])
            full = torch.log_softmax(model(seq).logits[0], -1)
            P = len(t.prompt_ids)
            # the logits at position P+i-1 score ids[i]
            expect = torch.stack([full[P + i - 1, tok] for i, tok in enumerate(t.ids)])
            s = P - batch["off"]
            assert torch.allclose(row[s : s + len(t.ids)], expect, atol=1e-5)


# ---------------------------------------------------------------- planning


def test_plan_micro_batches():
    lengths = [90, 30, 30, 30, 10, 50]
    plans = plan_micro_batches(lengths, 2, max_tokens=100)
    assert len(plans[0]) == len(plans[1])  # same number of forwards on each process
    flat = sorted(i for plan in plans for mb in plan for i in mb)
    assert flat == list(range(6))
    for plan in plans:
        for mb in plan:
            assert not mb or len(mb) * max(lengths[i] for i in mb) <= 100 or len(mb) == 1
    loads = [sum(lengths[i] for mb in plan for i in mb) for plan in plans]
    assert abs(loads[0] - loads[1]) <= 30
    # one process: a sequence longer than the budget goes alone; idle slots are padded with []
    assert plan_micro_batches([150, 20], 1, 100) == [[[0], [1]]]
    assert plan_micro_batches([90, 30, 30, 30], 2, 60) == [[[0], []], [[1, 2], [3]]]


@pytest.mark.parametrize(
    "n, size, sizes",
    [(3, 2, [3]), (10, 8, [10]), (16, 8, [8, 8]), (17, 8, [9, 8]), (23, 8, [12, 11]), (1, 8, [1]), (0, 8, []),
     (5, 1, [1] * 5)],
)  # fmt: skip
def test_mini_batch_slices_spread_leftovers(n, size, sizes):
    slices = mini_batch_slices(n, size)
    assert [b - a for a, b in slices] == sizes
    assert [i for a, b in slices for i in range(a, b)] == list(range(n))


def padding_share(lengths, micro_batches):
    """Share of padded positions over all positions the micro-batches compute."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches if mb)
    return (padded - real) / padded if padded else 0.0


def test_length_grouping_reduces_padding():
    lengths = [100, 10, 95, 12, 90, 8, 105, 11]
    grouped = plan_micro_batches(lengths, 1, 220, group_by_length=True)[0]
    plain = plan_micro_batches(lengths, 1, 220, group_by_length=False)[0]
    assert padding_share(lengths, grouped) < 0.1 < padding_share(lengths, plain)


# ---------------------------------------------------------------- join


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def rollout(tid, k, ids=(1, 2), mask=(1, 1)):
    tokens = {"prompt_ids": [3], "ids": list(ids), "mask": list(mask), "logprobs": [-1.0] * len(ids)}
    return {"task_id": tid, "sample_index": k, "tokens": tokens}


def diagnosis(tid, k, reward, profile=None):
    return {"task_id": tid, "sample_index": k, "reward": reward, "profile": profile or {"pass": 1.0}}


def join(tmp_path, rollouts, diagnoses, reweight=True):
    rp, dp = write(tmp_path / "r.jsonl", rollouts), write(tmp_path / "d.jsonl", diagnoses)
    return join_trajectories(read_jsonl(rp), read_jsonl(dp), RHO, reweight, rp, dp)


def test_join_counts_unplayed_turns(tmp_path):
    """A rollout force-quit in turn 1 of 3 has 2 labelled turns it never played; the weight
    still counts their labels (the paper's p_j), the count only feeds unplayed_share."""
    quit_early = rollout("a", 0) | {"turns": [{"steps": [], "end": "step_limit"}]}
    full = rollout("a", 1) | {"turns": [{}, {}, {}]}
    labels = ["invalid_tool_call", "missing_tool_call", "missing_tool_call"]
    profile = {"invalid_tool_call": 1 / 3, "missing_tool_call": 2 / 3}
    diags = [
        diagnosis("a", 0, 0, profile) | {"turn_labels": labels},
        diagnosis("a", 1, 1) | {"turn_labels": ["pass"] * 3},
    ]
    a, b = join(tmp_path, [quit_early, full], diags)
    assert (a.labelled_turns, a.unplayed_turns) == (3, 2) and (b.labelled_turns, b.unplayed_turns) == (3, 0)
    assert (a.weight, b.weight) == (pytest.approx(2.0 / 3 + 1.5 * 2 / 3), 1.0)
    # the weight ignores the advantage's sign: Σ A = 0 over the group, Σ w·A is not
    assert a.advantage + b.advantage == pytest.approx(0)
    assert a.weight * a.advantage + b.weight * b.advantage == pytest.approx(-(a.weight - 1.0), rel=1e-5)


def test_join_weights_and_advantages(tmp_path):
    ts = join(
        tmp_path,
        [rollout("a", 1), rollout("a", 0), rollout("b", 0)],
        [
            diagnosis("a", 0, 1, {"invalid_tool_call": 0.5, "pass": 0.5}),
            diagnosis("a", 1, 0),
            diagnosis("b", 0, 1),
        ],
    )
    assert [(t.task_id, t.sample_index, t.weight) for t in ts] == [
        ("a", 1, 1.0),
        ("a", 0, 1.5),
        ("b", 0, 1.0),
    ]
    assert ts[0].advantage == pytest.approx(-1, rel=1e-5) and ts[1].advantage == pytest.approx(1, rel=1e-5)
    assert ts[2].advantage == 0.0
    plain = join(
        tmp_path, [rollout("a", 0)], [diagnosis("a", 0, 1, {"invalid_tool_call": 1.0})], reweight=False
    )
    assert plain[0].weight == 1.0


def segmented(tid, k, segments):
    """A rollout whose tokens are several segments: (prompt_ids, ids, mask) each."""
    first, *more = [{"prompt_ids": list(p), "ids": list(i), "mask": list(m), "logprobs": [-1.0] * len(i)}
                    for p, i, m in segments]
    return {"task_id": tid, "sample_index": k, "tokens": first | {"segments": [s | {"turn": 1} for s in more]}}


def test_join_segments_carry_the_trajectory_advantage_and_weight(tmp_path):
    """A segmented rollout is one trajectory of its group (its advantage is the group's, counted
    once) whose sequences are its segments, each with the trajectory's A and w."""
    seg = segmented("a", 0, [([3], [1, 2], [1, 1]), ([3, 4, 5], [6, 7, 8], [1, 0, 1])])
    a, b = join(tmp_path, [seg, rollout("a", 1)], [diagnosis("a", 0, 1, {"invalid_tool_call": 1.0}), diagnosis("a", 1, 0)])
    assert [s.prompt_ids for s in a.sequences()] == [[3], [3, 4, 5]] and b.sequences() == [b]
    assert a.advantage == pytest.approx(1, rel=1e-5) and b.advantage == pytest.approx(-1, rel=1e-5)
    assert all((s.advantage, s.weight, s.reward) == (a.advantage, 2.0, 1.0) for s in a.sequences())
    assert sum(s.model_tokens for s in a.sequences()) == 4


@pytest.mark.parametrize("segments, message", [
    ([], r"r\.jsonl:1: tokens\.segments must be a non-empty list"),
    ("x", r"r\.jsonl:1: tokens\.segments must be a non-empty list"),
    ([{"prompt_ids": [1], "ids": [2], "mask": [1]}], r"r\.jsonl:1: tokens\.segments\[0\]: tokens\.logprobs missing"),
    ([{"prompt_ids": [], "ids": [2], "mask": [1], "logprobs": [0.0]}], r"tokens\.segments\[0\]: tokens\.prompt_ids is empty"),
])
def test_join_refuses_bad_segments(tmp_path, segments, message):
    rec = rollout("a", 0)
    rec["tokens"]["segments"] = segments
    with pytest.raises(RecordError, match=message):
        join(tmp_path, [rec], [diagnosis("a", 0, 1)])


def test_segments_are_scored_in_their_own_context_and_counted_once(tmp_path):
    """Each segment's log-probs are those of its own prompt + ids (not of the concatenated
    trajectory); the mini-batch's token-mean denominator counts every model token once; the
    loss of a segmented trajectory is the token-mean over all its segments' model tokens."""
    import argparse

    import accelerate

    import train_grpo
    from common.train.grpo import accumulate_gradients, score_trajectories

    segs = [([5, 6, 7], [1, 2, 3, 9], [1, 0, 0, 1]), ([5, 6, 8, 10], [11, 12, 13], [1, 0, 1])]
    a, b = join(tmp_path, [segmented("a", 0, segs), rollout("a", 1, ids=(4, 5, 6), mask=(1, 1, 0))],
                [diagnosis("a", 0, 1), diagnosis("a", 1, 0)])
    args = argparse.Namespace(seed=0, zero_variance="keep", mini_batch_tasks=8, max_tokens_per_micro_batch=16)
    acc = accelerate.Accelerator(cpu=True)
    (mb,), _ = train_grpo.plan_mini_batches(args, [a, b], acc)
    assert mb.trajs == [a, b] and sorted(map(id, (s for m in mb.mine for s in m))) == sorted(map(id, [*a.sequences(), b]))
    assert mb.norm == 2 + 2 + 2  # model tokens, each once
    model = small_qwen().eval()
    score_trajectories(model, mb.mine, "cpu", "old_logprobs")
    with torch.no_grad():
        for s in [*a.sequences(), b]:
            full = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.ids])).logits[0], -1)
            P = len(s.prompt_ids)
            expect = torch.stack([full[P + i - 1, tok] for i, tok in enumerate(s.ids)])
            m = torch.tensor(s.mask, dtype=torch.bool)
            assert torch.allclose(s.old_logprobs[m], expect[m], atol=1e-5)
    for s in [*a.sequences(), b]:
        s.ref_logprobs = s.old_logprobs
    model.train()
    totals = accumulate_gradients(model, acc, mb.mine, mb.norm)
    # at the input weights every ratio is 1: the loss is -Σ w·A over model tokens / their count
    expect = -(4 * a.weight * a.advantage + 2 * b.weight * b.advantage) / 6
    assert totals["tokens"] == 6 and totals["pg_sum"] / mb.norm == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize(
    "rollouts, diagnoses, message",
    [
        (
            [rollout("a", 0), rollout("a", 1)],
            [diagnosis("a", 0, 1)],
            r"r\.jsonl:2: no diagnosis for task a sample 1",
        ),
        (
            [rollout("a", 0)],
            [diagnosis("a", 0, 1), diagnosis("a", 3, 0)],
            r"d\.jsonl:2: no rollout for task a sample 3",
        ),
        (
            [rollout("a", 0)],
            [diagnosis("a", 0, 1, {"pass": 0.5, "oops": 0.5})],
            r"d\.jsonl:1: unknown label\(s\) oops",
        ),
        ([rollout("a", 0), rollout("a", 0)], [diagnosis("a", 0, 1)], r"r\.jsonl:2: second rollout"),
        ([rollout("a", 0, ids=(1, 2), mask=(1,))], [diagnosis("a", 0, 1)], r"r\.jsonl:1: tokens\.mask has 1"),
        (
            [rollout("a", 0, mask=(1, 2))],
            [diagnosis("a", 0, 1)],
            r"r\.jsonl:1: tokens\.mask must hold 0 or 1",
        ),
        ([rollout("a", 0)], [diagnosis("a", 0, "yes")], r"d\.jsonl:1: reward must be a number"),
    ],
)
def test_join_errors_name_file_and_line(tmp_path, rollouts, diagnoses, message):
    with pytest.raises(RecordError, match=message):
        join(tmp_path, rollouts, diagnoses)


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rollout("a", 0)) + "\n{not json\n")
    with pytest.raises(RecordError, match=r"r\.jsonl:2: not valid JSON"):
        read_jsonl(str(path), required=["task_id", "sample_index", "tokens"])


def test_rollout_temperature():
    def recs(*samplings):
        return [
            {"_line": i + 1} | ({"sampling": s} if s is not None else {}) for i, s in enumerate(samplings)
        ]

    at = {"temperature": 0.7, "top_p": 1.0, "top_k": 0}
    assert rollout_temperature(recs(at, at), "r.jsonl") == (0.7, 0)
    assert rollout_temperature(recs(None, None), "r.jsonl") == (1.0, 2)  # older files: T = 1
    assert rollout_temperature(recs(None, {"temperature": 1}), "r.jsonl") == (1.0, 1)
    assert rollout_temperature(recs({"temperature": 1.3, "top_p": None, "top_k": -1}), "r.jsonl") == (1.3, 0)
    for bad, message in [
        ((at, at | {"temperature": 1.0}), r"r\.jsonl:2: temperature 1 differs from 0\.7 at r\.jsonl:1"),
        ((at, None), r"r\.jsonl:2: temperature 1 differs from 0\.7"),
        ((at | {"temperature": 0},), r"r\.jsonl:1: temperature 0 \(greedy\)"),
        ((at | {"top_p": 0.9},), r"r\.jsonl:1: top-p / top-k"),
        ((at | {"top_k": 20},), r"r\.jsonl:1: top-p / top-k"),
        (({"temperature": "hot"},), r"r\.jsonl:1: sampling\.temperature must be"),
        (("0.7",), r"r\.jsonl:1: sampling\.temperature must be"),
    ]:
        with pytest.raises(RecordError, match=message):
            rollout_temperature(recs(*bad), "r.jsonl")


def test_token_logprobs_at_a_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 3
    targets = torch.randint(0, 11, (2, 5))
    expect = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, targets, 0.7), expect, atol=1e-6)
    assert torch.allclose(token_logprobs(logits.bfloat16(), targets, 0.7), expect, atol=0.1)


# ---------------------------------------------------------------- the objective beyond the paper's


def two_by_two(logp_a, logp_b, adv=(1.0, -1.0)):
    """Two trajectories of two model tokens each (a third, masked position holding junk), log π_θ of
    each token given, π_old = 0: the ratios are exp(logp)."""
    logp = torch.tensor([[*logp_a, 7.0], [*logp_b, float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([[adv[0]] * 3, [adv[1]] * 3])
    return logp, torch.zeros(2, 3), adv, mask


def test_clip_high_on_two_tokens_of_two_trajectories():
    """Ratios 1.5, 1.1 on A = +1 and 0.5, 1.3 on A = -1, clip 0.2: the symmetric clip caps 1.5 at 1.2
    and lifts 0.5 to 0.8; clip-higher 0.28 caps 1.5 at 1.28 and leaves 1.3 < its bound's loss alone."""
    ln = math.log
    for clip_high, expect in ((None, (-1.2 - 1.1 + 0.8 + 1.3) / 4), (0.28, (-1.28 - 1.1 + 0.8 + 1.3) / 4)):
        logp, old, adv, mask = two_by_two((ln(1.5), ln(1.1)), (ln(0.5), ln(1.3)))
        loss, stats = token_loss(logp, old, old, adv, mask, norm=4, clip=0.2, clip_high=clip_high)
        assert loss.item() == pytest.approx(expect, rel=1e-6)
        assert stats["clip_count"] == 2  # 1.5 (A > 0) and 0.5 (A < 0)
        loss.backward()
        # d/dlogp of -A·r is -A·r where unclipped, 0 where clipped: 1.1 and 1.3's tokens only
        assert logp.grad[mask].tolist() == pytest.approx([0, -1.1 / 4, 0, 1.3 / 4], abs=1e-7)


def test_dr_grpo_advantages_on_two_trajectories(tmp_path):
    """Rewards 1 and 0: A = ±1 with the std division (±0.5 / (0.5 + eps)), ±0.5 without (Dr. GRPO);
    at ratios 1.1, 1.0 and 1.0, 0.9 the token-mean loss is -(1.1 + 1.0 - 1.0 - 0.9)·|A| / 4."""
    ln = math.log
    for scale, a in (("group", 0.5 / (0.5 + ADV_EPS)), ("none", 0.5)):
        rp = write(tmp_path / "r.jsonl", [rollout("t", 0), rollout("t", 1)])
        dp = write(tmp_path / "d.jsonl", [diagnosis("t", 0, 1), diagnosis("t", 1, 0)])
        ta, tb = join_trajectories(read_jsonl(rp), read_jsonl(dp), RHO, adv_scale=scale)
        assert (ta.advantage, tb.advantage) == (pytest.approx(a, rel=1e-9), pytest.approx(-a, rel=1e-9))
        logp, old, adv, mask = two_by_two((ln(1.1), 0.0), (0.0, ln(0.9)), (ta.advantage, tb.advantage))
        loss, _ = token_loss(logp, old, old, adv, mask, norm=4)
        assert loss.item() == pytest.approx(-(1.1 + 1.0 - 1.0 - 0.9) * a / 4, rel=1e-6)
    with pytest.raises(ValueError, match="advantage scale"):
        group_advantages(["t"], [1], scale="std")


def test_gspo_sequence_ratio_on_two_trajectories():
    """GSPO: each row's tokens carry s = exp(mean log-ratio over its model tokens) (the masked junk
    left out): s_a = √(1.5·1.1) = 1.2845 on A = +1 is clipped at 1.2; s_b = √(0.5·1.3) = 0.8062 on
    A = -1 is inside the band. Each unclipped token's gradient is -A·s / norm (GSPO-token's form)."""
    ln = math.log
    logp, old, adv, mask = two_by_two((ln(1.5), ln(1.1)), (ln(0.5), ln(1.3)))
    loss, stats = token_loss(logp, old, old, adv, mask, norm=4, clip=0.2, level="sequence")
    s_b = math.sqrt(0.5 * 1.3)
    assert loss.item() == pytest.approx((-1.2 * 2 + s_b * 2) / 4, rel=1e-6)
    assert stats["clip_count"] == 2  # both of a's tokens
    loss.backward()
    assert logp.grad[mask].tolist() == pytest.approx([0, 0, s_b / 4, s_b / 4], rel=1e-6)
    assert torch.isfinite(logp.grad).all()


def test_token_entropy_in_the_chunked_pass():
    """The entropy sequence_logprobs returns beside the log-probs (one projection per chunk, kept
    once where backward recomputes the chunk) is -Σ p log p of softmax(logits / T) at model tokens."""
    batch = collate(CHUNK_TRAJS, "cpu")
    mask = batch["mask"]
    model = small_qwen()
    T, off = batch["input_ids"].shape[1], batch["off"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       logits_to_keep=T - off + 1).logits[:, :-1] / 0.7
        p = torch.softmax(logits, -1)
        expect = -(p * torch.log(p)).sum(-1)
    lp, ent = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], off, 0.7, mask, chunk=3,
                                entropy=True)
    assert torch.allclose(ent[mask], expect[mask], atol=1e-5) and (ent[~mask] == 0).all()
    assert not ent.requires_grad and lp.requires_grad
    lp.sum().backward()  # the chunks' recomputation in backward is the forward's, entropy or not
    plain = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], off, 0.7, mask, chunk=3)
    assert torch.equal(plain, lp)


def corrected_round(tmp_path, shift=None, missing=False):
    """Trajectories of two groups (rewards 1, 0, 0 and 0, 1) scored by a small model (π_old), whose
    engine log-probs are π_old's own, exactly; `shift` (sample key -> Δ) moves one trajectory's
    engine log-probs by Δ, so that its ratio π_old/μ is exp(-Δ)."""
    import accelerate

    recs = [rollout("a", 0, ids=(1, 2, 3), mask=(1, 0, 1)), rollout("a", 1, ids=(4, 5), mask=(1, 1)),
            rollout("a", 2, ids=(6, 7, 8), mask=(1, 1, 1)), rollout("b", 0, ids=(9, 10)),
            rollout("b", 1, ids=(11, 12, 13, 14), mask=(0, 1, 1, 1))]
    diags = [diagnosis("a", 0, 1), diagnosis("a", 1, 0), diagnosis("a", 2, 0), diagnosis("b", 0, 0),
             diagnosis("b", 1, 1)]
    trajs = join(tmp_path, recs, diags)
    model = small_qwen().eval()
    score_trajectories(model, [trajs], "cpu", "old_logprobs")
    for t in trajs:
        t.ref_logprobs = t.old_logprobs
        delta = (shift or {}).get((t.task_id, t.sample_index), 0.0)
        t.engine_logprobs = [lp + delta if m else None for lp, m in zip(t.old_logprobs.tolist(), t.mask, strict=True)]
    if missing:
        trajs[1].engine_logprobs[0] = None
    return model.train(), trajs, accelerate.Accelerator(cpu=True)


def step(model, acc, trajs, mode, cap=2.0, kl_coef=0.0):
    """rollout_correction then one mini-batch's gradient: (totals, hits per trajectory, gradient)."""
    hits = [rollout_correction(t, mode, cap) for t in trajs]
    model.zero_grad(set_to_none=True)
    totals = accumulate_gradients(model, acc, [trajs[:2], trajs[2:]], sum(t.model_tokens for t in trajs),
                                  kl_coef=kl_coef)
    return totals, hits, torch.cat([p.grad.flatten() for p in model.parameters()])


def test_every_correction_changes_nothing_where_the_engine_is_the_trainer(tmp_path):
    """Engine log-probs equal to the trainer's (float32 both, as on CPU): every ratio π_old/μ is 1,
    inside every band: each mode's loss and gradient are off's."""
    model, trajs, acc = corrected_round(tmp_path)
    off, _, g_off = step(model, acc, trajs, "off", kl_coef=0.1)
    assert abs(off["pg_sum"]) > 1e-3 and g_off.norm() > 1e-3
    for mode in ROLLOUT_IS[1:]:
        totals, hits, g = step(model, acc, trajs, mode, kl_coef=0.1)
        assert hits == [0] * len(trajs), mode
        assert totals["pg_sum"] == pytest.approx(off["pg_sum"], rel=1e-6, abs=1e-9), mode
        assert torch.allclose(g, g_off, rtol=1e-5, atol=1e-8), mode
        assert totals["entropy_sum"] == pytest.approx(off["entropy_sum"], rel=1e-6) and totals["entropy_sum"] > 0


def test_a_shifted_trajectory_is_truncated_or_dropped_exactly(tmp_path):
    """The engine gave sample a/1 log-probs 1 lower than π_old's (ratio e > cap 2): token-tis weighs
    exactly its tokens by 2, the update of doubling its advantage; 1 higher (ratio 1/e < 1/2):
    seq-mask drops exactly that sequence, the update of zeroing its advantage. The counts say so."""
    for delta, mode, factor in ((-1.0, "token-tis", 2.0), (-1.0, "seq-tis", 2.0), (1.0, "seq-mask", 0.0),
                                (1.0, "token-mask", 0.0), (1.0, "token-tis", math.exp(-1.0))):
        model, trajs, acc = corrected_round(tmp_path, shift={("a", 1): delta})
        totals, hits, g = step(model, acc, trajs, mode)
        shifted = trajs[1]
        hit = shifted.model_tokens if mode != "token-tis" or delta < 0 else 0  # 1/e is not above the cap
        assert hits == [0, hit, 0, 0, 0], mode
        assert shifted.is_weight.tolist() == pytest.approx([factor] * 2), mode
        # the same update off, with a/1's advantage scaled by the weight (ratio 1: the surrogate is -A·r)
        for t in trajs:
            t.is_weight = None
        a = shifted.advantage
        shifted.advantage = a * factor
        model.zero_grad(set_to_none=True)
        expect = accumulate_gradients(model, acc, [trajs[:2], trajs[2:]], sum(t.model_tokens for t in trajs))
        g_expect = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert totals["pg_sum"] == pytest.approx(expect["pg_sum"], rel=1e-5), mode
        assert torch.allclose(g, g_expect, rtol=1e-4, atol=1e-8), mode
    with pytest.raises(ValueError, match="rollout correction"):
        rollout_correction(trajs[0], "tis", 2.0)


def test_a_model_token_without_an_engine_logprob_is_refused_unless_off(tmp_path):
    model, trajs, acc = corrected_round(tmp_path, missing=True)
    with pytest.raises(RecordError, match="task a sample 1: a model token has no engine log-prob"):
        rollout_correction(trajs[1], "token-tis", 2.0)
    assert rollout_correction(trajs[1], "off", 2.0) == 0 and trajs[1].is_weight is None


def test_a_cut_trajectory_leaves_its_groups_statistics(tmp_path):
    """Group a: rewards 1, 0, 0 with a/2 cut (its stop a context limit training alone imposed): its
    A is 0 and a/0, a/1 are normalised as a group of two (±1), not of three; without the cut (keep)
    the three count. A group whose members are all cut has nothing to learn."""
    recs = [rollout("a", 0), rollout("a", 1), rollout("a", 2) | {"stop": "context_limit"},
            rollout("b", 0) | {"stop": "context_limit"}, rollout("b", 1) | {"stop": "context_limit"}]
    diags = [diagnosis("a", 0, 1), diagnosis("a", 1, 0), diagnosis("a", 2, 0), diagnosis("b", 0, 1),
             diagnosis("b", 1, 0)]
    rp, dp = write(tmp_path / "r.jsonl", recs), write(tmp_path / "d.jsonl", diags)
    cut = join_trajectories(read_jsonl(rp), read_jsonl(dp), RHO, cut=lambda r: r.get("stop") == "context_limit")
    assert [t.cut for t in cut] == [False, False, True, True, True]
    assert [t.advantage for t in cut] == [pytest.approx(1, rel=1e-5), pytest.approx(-1, rel=1e-5), 0, 0, 0]
    kept = join_trajectories(read_jsonl(rp), read_jsonl(dp), RHO)
    std = math.sqrt(2) / 3
    assert [t.advantage for t in kept][:3] == [pytest.approx(a / (std + ADV_EPS)) for a in (2 / 3, -1 / 3, -1 / 3)]
    assert not any(t.cut for t in kept)
    assert group_advantages(["b", "b"], [1, 0], cut=[True, True]) == ([0.0, 0.0], ["b"])


def test_each_environment_names_its_cuts():
    """BFCL: bfcl-eval's inference error, and the context limit only where training's context is
    shorter than evaluation's; its step limit is the policy's. τ²: the user simulator's error, the
    same context rule; τ²'s step limit and the agent's errors are the policy's."""
    from common.envs import cut_stops

    bfcl, tau = {"stop": "x"}, {"stop": "x", "env": "tau2:airline"}
    assert cut_stops(bfcl, True) == {"inference_error", "context_limit"}
    assert cut_stops(bfcl, False) == {"inference_error"}
    assert cut_stops(tau, True) == {"user_error", "context_limit"} and cut_stops(tau, False) == {"user_error"}
    assert not {"step_limit", "done"} & cut_stops(bfcl, True)
    assert not {"max_steps", "too_many_errors", "agent_error", "user_stop", "agent_stop"} & cut_stops(tau, True)


# ---------------------------------------------------------------- turn credit (seal-turn)


def step_rec(text="x"):
    return {"text": text, "calls": [], "parse_error": None, "results": [], "call_errors": [], "schema_errors": [],
            "feedback": None}


def turned(tid, k, turns, prompt, ids, mask, **extra):
    """A rollout record whose `turns` are (number of steps, end) each; one run of mask 1 per step."""
    return rollout(tid, k, ids, mask) | {"turns": [{"steps": [step_rec() for _ in range(n)], "end": end}
                                                   for n, end in turns]} | extra | {
        "tokens": {"prompt_ids": list(prompt), "ids": list(ids), "mask": list(mask), "logprobs": [-1.0] * len(ids)}}


def labelled(tid, k, reward, labels):
    return diagnosis(tid, k, reward, {z: labels.count(z) / len(labels) for z in LABELS}) | {"turn_labels": labels}


def turn_join(tmp_path, rollouts, diagnoses, **kwargs):
    rp, dp = write(tmp_path / "r.jsonl", rollouts), write(tmp_path / "d.jsonl", diagnoses)
    return join_trajectories(read_jsonl(rp), read_jsonl(dp), RHO, rollouts_path=rp, diagnoses_path=dp, **kwargs)


# Task t, two samples of two turns. Sample 0 (reward 0) passes turn 0 in two steps (model tokens at
# ids 0-1 and 3) and fails turn 1 (argument_mismatch) in one step (ids 6-8); sample 1 (reward 1) passes both.
HAND = ([turned("t", 0, [(2, "answer"), (1, "answer")], [5, 6], [1, 2, 3, 4, 9, 10, 11, 12, 13],
                [1, 1, 0, 1, 0, 0, 1, 1, 1]),
         turned("t", 1, [(1, "answer"), (1, "answer")], [5, 6], [14, 15, 16, 17, 18], [1, 1, 0, 0, 1])],
        [labelled("t", 0, 0, ["pass", "argument_mismatch"]), labelled("t", 1, 1, ["pass", "pass"])])


def test_turn_credit_on_a_hand_computed_group(tmp_path):
    """A = ∓0.5 / (0.5 + eps). Sample 0 (A < 0): its verified turn 0 weighs 0, its failing turn 1
    clip(ρ(argument_mismatch)) = 1.2 (seal would give all its tokens w = 0.5·1 + 0.5·1.2 = 1.1);
    sample 1 (A > 0): w = 1 on both turns. At the input weights every ratio is 1, so the token-mean
    loss over the 9 model tokens is -Σ Ã / 9 = -(3·0·(-a) + 3·1.2·(-a) + 3·1·a) / 9 = 0.6a / 9; seal's
    would be -(6·1.1·(-a) + 3·a) / 9 = 3.6a / 9."""
    import accelerate

    import train_grpo

    a = 0.5 / (0.5 + ADV_EPS)
    fail, ok = turn_join(tmp_path, *HAND, turn_credit=True)
    assert (fail.advantage, ok.advantage) == (pytest.approx(-a, rel=1e-12), pytest.approx(a, rel=1e-12))
    assert fail.weight == pytest.approx(1.1) and ok.weight == 1.0
    assert fail.turn_weights == [0.0, 1.2] and ok.turn_weights == [1.0, 1.0]
    assert fail.turn_spans == [(0, 2, 0), (3, 4, 0), (6, 9, 1)] and ok.turn_spans == [(0, 2, 0), (4, 5, 1)]
    assert (fail.turn_tokens, ok.turn_tokens) == ([3, 3], [2, 1])
    batch = collate([fail, ok], "cpu")
    # the per-token advantages: each model token A × its turn's weight (the masked ones are never read)
    want = torch.tensor([[0, 0, 0, 0, 0, 0, -1.2 * a, -1.2 * a, -1.2 * a], [a, a, 0, 0, a, 0, 0, 0, 0]])
    assert torch.equal(batch["adv"][batch["mask"]], want.float()[batch["mask"]])
    model, acc = small_qwen().eval(), accelerate.Accelerator(cpu=True)
    score_trajectories(model, [[fail, ok]], "cpu", "old_logprobs")
    for t in (fail, ok):
        t.ref_logprobs = t.old_logprobs
    model.train()
    totals = accumulate_gradients(model, acc, [[fail, ok]], norm=9, kl_coef=0.0)
    hand = -(3 * 0.0 * -a + 3 * 1.2 * -a + 3 * 1.0 * a) / 9  # turn 0 of sample 0, its turn 1, sample 1
    assert totals["tokens"] == 9 and totals["pg_sum"] / 9 == pytest.approx(hand, rel=1e-6)
    assert hand == pytest.approx(0.2 * a / 3) and hand != pytest.approx(-(6 * 1.1 * -a + 3 * a) / 9)  # not seal's
    # the gradient is that of the hand-weighted sum -Σ_t Ã_t log π(y_t) / N
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["off"], mask=batch["mask"])
    (-(torch.where(batch["mask"], lp, 0.0) * want).sum() / 9).backward()
    assert torch.allclose(g, torch.cat([p.grad.flatten() for p in model.parameters()]), rtol=1e-5, atol=1e-8)
    stats = train_grpo.turn_stats([fail, ok])
    assert stats == {"turn_zeroed_share": 0.5, "turn_w_mean": pytest.approx((0 + 1.2 + 1 + 1) / 4)}


@pytest.mark.parametrize("objective", [dict(level="sequence"), dict(clip_high=0.28), dict(rollout="token-tis"),
                                       dict(rollout="seq-mask", level="sequence", clip_high=0.28)])
def test_turn_credit_works_with_the_objectives_options(tmp_path, objective):
    """GSPO's sequence ratio, clip-higher and the rollout correction act on the per-token advantages as
    on seal's: at the input weights (ratios 1, engine = trainer) the loss is the hand-computed one."""
    import accelerate

    a = 0.5 / (0.5 + ADV_EPS)
    trajs = turn_join(tmp_path, *HAND, turn_credit=True)
    model, acc = small_qwen().eval(), accelerate.Accelerator(cpu=True)
    score_trajectories(model, [trajs], "cpu", "old_logprobs")
    for t in trajs:
        t.ref_logprobs = t.old_logprobs
        t.engine_logprobs = [lp if m else None for lp, m in zip(t.old_logprobs.tolist(), t.mask, strict=True)]
        rollout_correction(t, objective.get("rollout", "off"), 2.0)
    totals = accumulate_gradients(model.train(), acc, [trajs], norm=9, clip_high=objective.get("clip_high"),
                                  level=objective.get("level", "token"))
    assert totals["pg_sum"] / 9 == pytest.approx(-(3 * 1.2 * -a + 3 * a) / 9, rel=1e-6)


def test_turn_credit_on_one_turn_tasks_is_seals_gradient(tmp_path):
    """One-turn tasks: every trajectory's one turn weighs its w (A > 0: w; A < 0: a failing label's
    clip(ρ) is w, and a pass that the step limit stopped, or with no failure anywhere, is not cleared),
    so the per-token advantages, the loss and the gradient are seal's, bit for bit."""
    import accelerate

    recs = [turned("a", 0, [(2, "answer")], [3], [1, 2, 0, 4], [1, 1, 0, 1]),
            turned("a", 1, [(1, "answer")], [3], [5, 6, 7], [1, 1, 1]),
            turned("a", 2, [(3, "step_limit")], [3], [8, 9, 0, 10, 0, 11], [1, 1, 0, 1, 0, 1], stop="step_limit"),
            turned("a", 3, [(1, "answer")], [3, 4], [12, 13], [1, 1]),
            turned("b", 0, [(1, "answer")], [3], [14, 15], [1, 1]),
            turned("b", 1, [(2, "decode_error")], [3], [16, 0, 17], [1, 0, 1])]
    diags = [labelled("a", 0, 1, ["pass"]), labelled("a", 1, 0, ["invalid_tool_call"]),
             labelled("a", 2, 0, ["pass"]), labelled("a", 3, 0, ["response_mismatch"]),
             labelled("b", 0, 0, ["missing_tool_call"]), labelled("b", 1, 1, ["pass"])]
    grads = {}
    for credit in (False, True):
        trajs = turn_join(tmp_path, recs, diags, turn_credit=credit)
        if credit:
            assert all(t.turn_weights == [t.weight] for t in trajs) and trajs[2].advantage < 0
        model, acc = small_qwen().eval(), accelerate.Accelerator(cpu=True)
        score_trajectories(model, [trajs], "cpu", "old_logprobs")
        for t in trajs:
            t.ref_logprobs = t.old_logprobs
        batch = collate(trajs, "cpu")
        grads[credit] = (batch["adv"][batch["mask"]], accumulate_gradients(model.train(), acc, [trajs[:3], trajs[3:]],
                                                                            norm=14, kl_coef=0.01),
                         torch.cat([p.grad.flatten() for p in model.parameters()]))
    (adv0, tot0, g0), (adv1, tot1, g1) = grads[False], grads[True]
    assert torch.equal(adv0, adv1) and torch.equal(g0, g1) and g0.norm() > 0
    assert tot0["pg_sum"] == tot1["pg_sum"] and tot0["kl_sum"] == tot1["kl_sum"]


def test_turn_credit_clears_only_turns_the_environment_verified(tmp_path):
    """With A < 0 a pass turn weighs 0 only where the environment checked it at that turn: not in a τ²
    episode (one verdict per episode: the trajectory's w), not in a turn the step limit stopped, not in
    a trajectory whose diagnosis blames no turn. Without reweighting (ρ ≡ 1) a failing turn weighs 1."""
    from common.train.grpo import turn_weights

    labels, ends = ["pass", "correct_abstention", "state_mismatch", "missing_tool_call"], ["answer"] * 3
    assert turn_weights(labels, ends, -1.0, 1.3, RHO) == [0.0, 0.0, 1.0, 1.5]  # turn 3 never played
    assert turn_weights(labels, ends, -1.0, 1.3, RHO, checked=False) == [1.3, 1.3, 1.0, 1.5]  # τ²
    assert turn_weights(labels, ["step_limit", "answer"], -1.0, 1.3, RHO)[:2] == [1.3, 0.0]
    assert turn_weights(["pass", "pass"], ends, -1.0, 1.0, RHO) == [1.0, 1.0]  # no turn to blame
    assert turn_weights(labels, ends, -1.0, 1.0, RHO, reweight=False) == [0.0, 0.0, 1.0, 1.0]
    assert turn_weights(labels, ends, 0.5, 1.3, RHO) == [1.3] * 4
    assert turn_weights(["invalid_tool_call"], ends, -1.0, 2.0, {"invalid_tool_call": 3.0}) == [2.0]  # clipped
    tau = [turned("t", 0, [(1, "answer"), (1, "answer")], [5], [1, 0, 2], [1, 0, 1], env="tau2:airline"),
           turned("t", 1, [(1, "answer"), (1, "answer")], [5], [3, 0, 4], [1, 0, 1], env="tau2:airline")]
    from common.envs import checks_turns  # the stage asks the registry and hands grpo the answer

    fail, _ = turn_join(tmp_path, tau, [labelled("t", 0, 0, ["pass", "state_mismatch"]),
                                        labelled("t", 1, 1, ["pass", "pass"])], turn_credit=True, checked=checks_turns)
    assert fail.turn_weights == [fail.weight, 1.0] and fail.weight == 1.0


@pytest.mark.parametrize("change, message", [
    (lambda r, d: d.pop("turn_labels"), r"d\.jsonl:1: turn_labels missing"),
    (lambda r, d: d.update(turn_labels=["pass", "made_up"]), r"d\.jsonl:1: unknown label\(s\) made_up in turn_labels"),
    (lambda r, d: r.pop("turns"), r"r\.jsonl:1: turns missing"),
    (lambda r, d: r["turns"][0]["steps"].append(step_rec()), r"r\.jsonl:1: 3 model outputs in tokens, 4 steps in turns"),
    (lambda r, d: d.update(turn_labels=["pass"]), r"r\.jsonl:1: 2 turns played, 1 labelled in .*d\.jsonl:1"),
])
def test_turn_credit_refuses_records_it_cannot_place(tmp_path, change, message):
    recs, diags = json.loads(json.dumps(HAND))
    change(recs[0], diags[0])
    with pytest.raises(RecordError, match=message):
        turn_join(tmp_path, recs, diags, turn_credit=True)


def test_turn_credit_places_segments_and_skips_outputs_that_kept_no_token(tmp_path):
    """A thinking model's re-rendered segment holds the later turns' runs; an output that kept no token
    (its step's text empty) has no run, and the runs go to the steps that spoke."""
    rec = turned("t", 0, [(1, "answer"), (2, "answer")], [5], [1, 2, 0], [1, 1, 0])
    rec["turns"][1]["steps"][0]["text"] = ""
    rec["tokens"]["segments"] = [{"turn": 1, "prompt_ids": [5, 6], "ids": [3, 4], "mask": [1, 1],
                                  "logprobs": [-1.0, -1.0]}]
    other = turned("t", 1, [(1, "answer"), (1, "answer")], [5], [1, 0, 2], [1, 0, 1])
    fail, _ = turn_join(tmp_path, [rec, other], [labelled("t", 0, 0, ["pass", "recovery_failure"]),
                                                 labelled("t", 1, 1, ["pass", "pass"])], turn_credit=True)
    first, second = fail.sequences()
    assert first.turn_spans == [(0, 2, 0)] and second.turn_spans == [(0, 2, 1)]
    assert fail.turn_tokens == [2, 2] and fail.turn_weights == [0.0, 1.2]
    adv = collate([second], "cpu")["adv"]
    assert adv[0, -2:].tolist() == pytest.approx([1.2 * fail.advantage] * 2)
