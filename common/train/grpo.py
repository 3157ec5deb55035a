"""Diagnosis-guided GRPO: advantages, SEAL weight, turn credit, per-token loss, and the batching that feeds them
to a causal LM (the formulas and every option: docs/design.md §6). A sequence is `prompt_ids + ids` (a segmented
trajectory: several); ids[i] is scored by the logits at P+i-1; only ids with mask 1 (model tokens) carry loss.
"""

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType, extract_model_from_parallel
from torch.utils.checkpoint import checkpoint

from common.jsonl import RecordError, read_json
from common.presets import LOGPROB_CHUNK  # positions projected onto the vocabulary at once
from common.seal.interface import FAILURE_LABELS
from common.seal.taxonomy import RHO

WEIGHT_MIN, WEIGHT_MAX = 0.5, 2.0
ADV_EPS = 1e-6
ENTROPY_ROWS = 256  # positions whose entropy is computed at once (token_entropy)
# the choices of train_grpo.py's objective flags (common/presets.py holds the defaults)
ROLLOUT_IS = ("off", "token-tis", "token-mask", "seq-tis", "seq-mask")
ADV_SCALES = ("group", "none")
RATIO_LEVELS = ("token", "sequence")


def number(v):
    """A finite int or float (not a bool): what a record's numbers must be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------- advantages and weights
def group_advantages(group_ids, rewards, eps=ADV_EPS, scale="group", cut=None):
    """(A_j = (r_j - mean) / (std + eps) per group, or r_j - mean; the groups of equal rewards). `cut`: A = 0."""
    if scale not in ADV_SCALES:
        raise ValueError(f"advantage scale {scale!r}: use {' or '.join(ADV_SCALES)}")
    groups = {}
    for j, g in enumerate(group_ids):
        if not (cut and cut[j]):
            groups.setdefault(g, []).append(j)
    adv = [0.0] * len(rewards)
    zero_var = sorted(set(group_ids) - set(groups), key=list(group_ids).index)  # every member cut
    for g, members in groups.items():
        rs = [float(rewards[j]) for j in members]
        if max(rs) == min(rs):
            zero_var.append(g)
            continue
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs)) if scale == "group" else 0.0
        for j, r in zip(members, rs, strict=True):
            adv[j] = (r - mean) / (std + eps) if scale == "group" else r - mean
    return adv, zero_var


def diagnosis_weight(profile, rho, lo=WEIGHT_MIN, hi=WEIGHT_MAX):
    """SEAL weight w = clip(Σ_z p(z)·ρ(z), lo, hi) of one trajectory's label profile {label: fraction}."""
    unknown = sorted(z for z in profile if z not in rho)
    if unknown:
        raise KeyError(f"unknown label(s) {', '.join(unknown)} (ρ knows {', '.join(sorted(rho))})")
    s = sum(float(p) * float(rho[z]) for z, p in profile.items())
    return min(max(s, lo), hi)


@dataclass(frozen=True)
class AdaptedRho:
    """The ρ a round trains with under --adaptive-rho, and what the rule saw (train_metrics records it)."""
    rho: dict  # ρ_t
    learnable: dict  # s_z of every failure label the round's profiles hold
    scale: float  # c
    kept: str | None  # why ρ_t is the table unchanged, or None when the rule moved it


def adaptive_rho(rho, diagnoses):
    """ρ_t of a round's checked diagnoses {task_id, reward, profile}: the mixed-group rule, docs/design.md §6."""
    adv, flat = group_advantages([d["task_id"] for d in diagnoses], [d["reward"] for d in diagnoses])
    flat = set(flat)
    mass, mixed = {}, {}
    for d in diagnoses:
        for z, p in d["profile"].items():
            if z in FAILURE_LABELS and p > 0:
                mass[z] = mass.get(z, 0.0) + p
                mixed[z] = mixed.get(z, 0.0) + (p if d["task_id"] not in flat else 0.0)
    learnable = {z: mixed[z] / mass[z] for z in FAILURE_LABELS if z in mass}
    if not learnable:
        return AdaptedRho(dict(rho), {}, 1.0, "no failure in the round's diagnoses")
    if sum(s > 0 for s in learnable.values()) < 2:
        return AdaptedRho(dict(rho), learnable, 1.0, "fewer than two failure labels in groups with differing rewards")
    if any(rho[z] < 0 for z in learnable):
        raise RecordError("ρ: the adaptive rule scales non-negative utilities only")
    live = [d["profile"] for d, a in zip(diagnoses, adv, strict=True) if a != 0]

    def table(c):
        return rho | {z: c * rho[z] * (1 + s) / 2 for z, s in learnable.items()}

    def mean_weight(r):
        return sum(diagnosis_weight(p, r) for p in live) / len(live)

    target, lo, hi = mean_weight(rho), 1.0, 2.0
    for _ in range(60):  # g(c) = mean_weight(table(c)) is non-decreasing, g(1) <= target <= g(2)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_weight(table(mid)) < target else (lo, mid)
    return AdaptedRho(table(hi), learnable, hi, None)


def load_rho(interface_path=None, rho_path=None):
    """ρ: the interface file's "rho" if it has one, else the JSON object in `rho_path`, else taxonomy.RHO."""
    path, rho = rho_path, RHO
    if interface_path:
        path, interface = interface_path, read_json(interface_path)
        if not isinstance(interface, dict):
            raise RecordError(f"{path}: expected a JSON object")
        rho = interface["rho"] if interface.get("rho") is not None else RHO
    elif rho_path:
        rho = read_json(rho_path)
    if not isinstance(rho, dict) or not all(number(v) for v in rho.values()):
        raise RecordError(f"{path}: ρ must be a JSON object mapping labels to numbers")
    return rho


# ---------------------------------------------------------------- turn credit (seal-turn)
VERIFIED_LABELS = ("pass", "correct_abstention")  # the labels of a turn the checker found right
CHECKED_ENDS = ("answer", "decode_error")  # a turn that ended as turns end: not the limit that stopped its trajectory


def turn_weights(labels, ends, advantage, weight, rho, checked=True, reweight=True):
    """Each labelled turn's weight v_k under turn credit (docs/design.md §6)."""
    if advantage >= 0:
        return [weight] * len(labels)
    blamed = any(z not in VERIFIED_LABELS for z in labels)
    out = []
    for k, z in enumerate(labels):
        if z in VERIFIED_LABELS:
            cleared = checked and blamed and k < len(ends) and ends[k] in CHECKED_ENDS
            out.append(0.0 if cleared else weight)
        else:
            out.append(diagnosis_weight({z: 1.0}, rho) if reweight else 1.0)
    return out


def turn_spans(segments, turns, where="rollouts"):
    """Per token segment, the (start, stop, turn) of each run of mask 1: the k-th run is the k-th step."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("steps"), list)
                                              for t in turns):
        raise RecordError(f"{where}: turns missing or not a list of {{steps}} (turn credit places tokens on turns)")
    runs = []  # (segment, start, stop)
    for i, seg in enumerate(segments):
        start = None
        for j, m in enumerate([*seg["mask"], 0]):
            if m and start is None:
                start = j
            elif not m and start is not None:
                runs.append((i, start, j))
                start = None
    steps = [(k, s) for k, t in enumerate(turns) for s in t["steps"]]
    if len(runs) != len(steps):
        spoken = [(k, s) for k, s in steps if not isinstance(s, dict) or s.get("text") != ""]
        if len(runs) != len(spoken):
            raise RecordError(f"{where}: {len(runs)} model outputs in tokens, {len(steps)} steps in turns: "
                              "the model's tokens cannot be placed on its turns")
        steps = spoken
    out = [[] for _ in segments]
    for (i, lo, hi), (k, _) in zip(runs, steps, strict=True):
        out[i].append((lo, hi, k))
    return out


# ---------------------------------------------------------------- per-token loss
def token_logprobs(logits, targets, temperature=1.0):
    """log softmax(logits / temperature)[targets], aligned: logits[..., t, :] scores targets[..., t]."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # divided after the upcast: bf16 would round the scaled logits again
    if temperature != 1.0:
        logits = logits / temperature
    # the fused log_softmax + gather: about twice as fast as gather - logsumexp in forward + backward
    return -F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)


def kl_k3(logp, ref_logp):
    """Low-variance KL estimate per token, k3 = exp(ref - new) - (ref - new) - 1 (>= 0, unbiased)."""
    # bounded as in verl: one token pushed far below the reference must not dominate (nor overflow into nan)
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1, max=10.0)


def token_entropy(logits, temperature=1.0):
    """Entropy of softmax(logits / temperature) per position, logsumexp(z) − Σ p·z: logged, no gradient."""
    with torch.no_grad():
        out = []
        # a quarter of a chunk's float32 buffers: below the chunk's backward, which memplan counts
        for rows in logits.flatten(0, -2).split(ENTROPY_ROWS):
            z = rows.float() / temperature  # a new tensor even at T = 1: the in-place steps keep logits
            lse = torch.logsumexp(z, -1)
            out.append(lse - (z - lse[:, None]).exp_().mul_(z).sum(-1))
        return torch.cat(out).view(logits.shape[:-1])


def policy_ratio(logp, old_logp, mask=None, level="token"):
    """π_θ/π_old per token; "sequence" (GSPO-token): the row's exp(mean log π_θ/π_old), own gradients."""
    if level == "token":
        # bounded so that a token the policy has moved far from cannot overflow exp
        return torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    if level != "sequence":
        raise ValueError(f"ratio level {level!r}: use {' or '.join(RATIO_LEVELS)}")
    # torch.where: a masked-out position may hold inf/nan (padding)
    diff = torch.where(mask, logp - old_logp, 0.0).detach()
    seq = diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    live = torch.where(mask, logp, 0.0)
    return torch.exp(torch.clamp(live - live.detach() + seq, max=20.0))


def clipped_surrogate(logp, old_logp, adv, clip=0.2, clip_ratio_c=3.0, clip_high=None, mask=None, level="token"):
    """(loss, PPO-clipped, dual-clipped) per token: max(-A·r, -A·clip(r, 1-c, 1+c_high)), ≤ -A·clip_ratio_c."""
    ratio = policy_ratio(logp, old_logp, mask, level)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + (clip if clip_high is None else clip_high))
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if clip_ratio_c:
        cap = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return loss, clipped > unclipped, dual


def token_loss(logp, old_logp, ref_logp, adv, mask, norm, clip=0.2, kl_coef=0.0, clip_ratio_c=3.0,
               clip_high=None, level="token", is_weight=None):
    """(Σ over model tokens of is_weight·surrogate + kl_coef·k3 / `norm` (token-mean), detached sums)."""
    pg, clipped, dual = clipped_surrogate(logp, old_logp, adv, clip, clip_ratio_c, clip_high, mask, level)
    if is_weight is not None:
        pg = pg * is_weight
    kl = kl_k3(logp, ref_logp) if kl_coef > 0 else None
    per_token = pg if kl is None else pg + kl_coef * kl
    # torch.where rather than a product: a masked-out position may hold inf/nan (padding)
    loss = torch.where(mask, per_token, 0.0).sum() / norm
    return loss, {"pg_sum": torch.where(mask, pg, 0.0).sum().item(),
                  "kl_sum": torch.where(mask, kl, 0.0).sum().item() if kl is not None else 0.0,
                  "clip_count": (clipped & mask).sum().item(), "dual_clip_count": (dual & mask).sum().item(),
                  "tokens": mask.sum().item()}


def rollout_correction(seq, mode, cap):
    """Set seq.is_weight from ρ = π_old/μ under `mode` ("off", "token-tis", ...: docs/design.md §6); returns seq.is_hits."""
    if mode not in ROLLOUT_IS:
        raise ValueError(f"rollout correction {mode!r}: use {', '.join(ROLLOUT_IS)}")
    if mode == "off":
        seq.is_weight, seq.is_hits = None, 0
        return 0
    mask = torch.tensor(seq.mask, dtype=torch.bool)
    if any(e is None for e, m in zip(seq.engine_logprobs, seq.mask, strict=True) if m):
        raise RecordError(f"task {seq.task_id} sample {seq.sample_index}: a model token has no engine log-prob")
    engine = torch.tensor([0.0 if e is None else float(e) for e in seq.engine_logprobs])
    log_ratio = torch.where(mask, seq.old_logprobs.double() - engine.double(), 0.0)
    if mode.startswith("seq"):
        log_ratio = torch.full_like(log_ratio, (log_ratio.sum() / max(int(mask.sum()), 1)).item())
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    if mode.endswith("tis"):
        hit = ratio > cap
        weight = torch.clamp(ratio, max=cap)
    else:
        hit = (ratio < 1.0 / cap) | (ratio > cap)
        weight = (~hit).double()
    seq.is_weight = torch.where(mask, weight, 1.0).float()
    seq.is_hits = int((hit & mask).sum())
    return seq.is_hits


# ---------------------------------------------------------------- trajectories
@dataclass
class TrainingSequence:
    """A rollout joined with its diagnosis as the trainer scores it (a segmented one: its first segment)."""
    task_id: str
    sample_index: int
    prompt_ids: list
    ids: list
    mask: list
    engine_logprobs: list
    reward: float
    weight: float
    advantage: float = 0.0  # A_j; the trained advantage is weight * advantage (turn credit: turn_weights)
    labelled_turns: int = 0  # turns the diagnosis labelled (every user turn of the task)
    unplayed_turns: int = 0  # of those, turns the rollout never entered (it stopped earlier)
    stop: str | None = None  # the rollout's end (its record's "stop")
    cut: bool = False  # an end that is not the policy's failure: out of the loss and the group's statistics
    old_logprobs: torch.Tensor | None = field(default=None, repr=False)  # aligned with ids
    ref_logprobs: torch.Tensor | None = field(default=None, repr=False)
    is_weight: torch.Tensor | None = field(default=None, repr=False)  # rollout_correction's, aligned with ids
    is_hits: int = 0  # of its model tokens, those rollout_correction truncated or masked
    segments: list = field(default_factory=list, repr=False)  # the further segments, TrainingSequences
    # turn credit (else None): this sequence's turn_spans, the trajectory's weight and model tokens per turn
    turn_spans: list | None = field(default=None, repr=False)
    turn_weights: list | None = None
    turn_tokens: list | None = None

    def sequences(self):
        """Every sequence the trainer scores for this trajectory: itself, then its further segments."""
        return [self, *self.segments]

    @property
    def length(self):
        return len(self.prompt_ids) + len(self.ids)

    @property
    def model_tokens(self):
        return sum(self.mask)


def token_segments(tokens, where="rollouts"):
    """The checked sequences of a rollout record's `tokens`: itself, then each of `tokens.segments`."""
    _check_tokens(tokens, where)
    more = tokens.get("segments", [])
    if not isinstance(more, list) or not more and "segments" in tokens:
        raise RecordError(f"{where}: tokens.segments must be a non-empty list when present")
    for k, seg in enumerate(more):
        _check_tokens(seg, f"{where}: tokens.segments[{k}]")
    return [tokens, *more]


def _check_tokens(tokens, where):
    if not isinstance(tokens, dict):
        raise RecordError(f"{where}: tokens must be an object")
    for k in ("prompt_ids", "ids", "mask", "logprobs"):
        if not isinstance(tokens.get(k), list):
            raise RecordError(f"{where}: tokens.{k} missing or not a list")
    n = len(tokens["ids"])
    for k in ("mask", "logprobs"):
        if len(tokens[k]) != n:
            raise RecordError(f"{where}: tokens.{k} has {len(tokens[k])} entries, tokens.ids has {n}")
    if not tokens["prompt_ids"]:
        raise RecordError(f"{where}: tokens.prompt_ids is empty (the first id has no logits to score it)")
    for k in ("prompt_ids", "ids"):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens[k]):
            raise RecordError(f"{where}: tokens.{k} must hold non-negative integers")
    if not all(m in (0, 1) for m in tokens["mask"]):
        raise RecordError(f"{where}: tokens.mask must hold 0 or 1")
    if not all(lp is None or isinstance(lp, (int, float)) for lp in tokens["logprobs"]):
        raise RecordError(f"{where}: tokens.logprobs must hold numbers or null")


def _key(rec, where):
    tid, idx = rec["task_id"], rec["sample_index"]
    if not isinstance(tid, str) or not isinstance(idx, int) or isinstance(idx, bool):
        raise RecordError(f"{where}: task_id must be a string and sample_index an integer")
    return tid, idx


def join_trajectories(rollouts, diagnoses, rho, reweight=True, rollouts_path="rollouts", diagnoses_path="diagnoses",
                      adv_scale="group", cut=None, turn_credit=False, checked=None):
    """Rollout and diagnosis records joined on (task_id, sample_index), with weights and group advantages."""
    diag_by_key = {}
    for d in diagnoses:
        where = f"{diagnoses_path}:{d.get('_line', '?')}"
        key = _key(d, where)
        if key in diag_by_key:
            raise RecordError(f"{where}: second diagnosis for task {key[0]} sample {key[1]}")
        if not number(d["reward"]):
            raise RecordError(f"{where}: reward must be a number")
        profile = d["profile"]
        if not isinstance(profile, dict) or not all(number(p) and 0 <= p <= 1 for p in profile.values()):
            raise RecordError(f"{where}: profile must map labels to fractions in [0, 1]")
        try:
            weight = diagnosis_weight(profile, rho)
        except KeyError as e:
            raise RecordError(f"{where}: {e.args[0]}") from None
        if turn_credit:
            labels = d.get("turn_labels")
            if not isinstance(labels, list) or not labels or not all(isinstance(z, str) for z in labels):
                raise RecordError(f"{where}: turn_labels missing or not a non-empty list of labels (turn credit "
                                  "weighs each turn by its label)")
            unknown = sorted({z for z in labels if z not in rho})
            if unknown:
                raise RecordError(f"{where}: unknown label(s) {', '.join(unknown)} in turn_labels "
                                  f"(ρ knows {', '.join(sorted(rho))})")
        diag_by_key[key] = (d, weight if reweight else 1.0)

    trajectories, seen = [], set()
    for r in rollouts:
        where = f"{rollouts_path}:{r.get('_line', '?')}"
        key = _key(r, where)
        if key in seen:
            raise RecordError(f"{where}: second rollout for task {key[0]} sample {key[1]}")
        seen.add(key)
        if key not in diag_by_key:
            raise RecordError(f"{where}: no diagnosis for task {key[0]} sample {key[1]} in {diagnoses_path}")
        d, weight = diag_by_key[key]
        segments = token_segments(r["tokens"], where)
        labelled = len(d.get("turn_labels") or [])
        first, *more = [TrainingSequence(
            task_id=key[0], sample_index=key[1], prompt_ids=t["prompt_ids"], ids=t["ids"], mask=t["mask"],
            engine_logprobs=t["logprobs"], reward=float(d["reward"]), weight=weight, labelled_turns=labelled,
            unplayed_turns=max(0, labelled - len(r.get("turns") or [])), stop=r.get("stop"), cut=bool(cut and cut(r)),
        ) for t in segments]
        first.segments = more
        if turn_credit:
            spans = turn_spans(segments, r.get("turns"), where)
            if len(r["turns"]) > len(d["turn_labels"]):
                raise RecordError(f"{where}: {len(r['turns'])} turns played, {len(d['turn_labels'])} labelled "
                                  f"in {diagnoses_path}:{d.get('_line', '?')}")
            tokens = [0] * len(d["turn_labels"])
            for seq, seq_spans in zip(first.sequences(), spans, strict=True):
                seq.turn_spans = seq_spans
                for lo, hi, k in seq_spans:
                    tokens[k] += hi - lo
            first.turn_tokens = tokens
        trajectories.append(first)
    for key, (d, _) in diag_by_key.items():
        if key not in seen:
            raise RecordError(f"{diagnoses_path}:{d.get('_line', '?')}: no rollout for task {key[0]} sample {key[1]} "
                              f"in {rollouts_path}")

    adv, _ = group_advantages([t.task_id for t in trajectories], [t.reward for t in trajectories],
                              scale=adv_scale, cut=[t.cut for t in trajectories])
    for t, r, a in zip(trajectories, rollouts, adv, strict=True):  # one trajectory per rollout, in order
        if turn_credit:
            d, _ = diag_by_key[t.task_id, t.sample_index]
            t.turn_weights = turn_weights(d["turn_labels"], [turn.get("end") for turn in r["turns"]], a, t.weight,
                                          rho, checked is None or checked(r), reweight)
        for seq in t.sequences():
            seq.advantage = a
            seq.turn_weights = t.turn_weights
    return trajectories


def as_trained(trained):
    """join_trajectories' adv_scale and cut as train_grpo.py used them, from a train_metrics.jsonl line."""
    stops = set((trained or {}).get("cut_stops") or [])
    return {"adv_scale": ((trained or {}).get("objective") or {}).get("adv_scale", "group"),
            "cut": (lambda r: r.get("stop") in stops) if stops else None}


def join_round(rollouts, diagnoses, rho, reweight=True, adaptive=False, **kwargs):
    """(join_trajectories under the round's ρ: `rho`, or with `adaptive` its ρ_t, AdaptedRho or None)."""
    trajectories = join_trajectories(rollouts, diagnoses, rho, reweight, **kwargs)
    if not adaptive:
        return trajectories, None
    adapted = adaptive_rho(rho, diagnoses)
    return join_trajectories(rollouts, diagnoses, adapted.rho, reweight, **kwargs), adapted


def rollout_temperature(rollouts, path="rollouts"):
    """(T, n): a rollout file's one sampling temperature and how many records carry none (read as 1)."""
    temperature, first, missing = None, None, 0
    for r in rollouts:
        where = f"{path}:{r.get('_line', '?')}"
        sampling = r.get("sampling")
        if sampling is None:
            missing += 1
            t = 1.0
        else:
            t = sampling.get("temperature") if isinstance(sampling, dict) else None
            if not number(t) or t < 0:
                raise RecordError(f"{where}: sampling.temperature must be a non-negative number")
            if t == 0:
                raise RecordError(f"{where}: temperature 0 (greedy) rollouts cannot be trained on; sample at T > 0")
            neutral = {"top_p": (1,), "top_k": (0, -1), "min_p": (0,), "repetition_penalty": (1,),
                       "presence_penalty": (0,), "frequency_penalty": (0,)}
            if any(sampling.get(k) not in (None, *v) for k, v in neutral.items()):
                raise RecordError(f"{where}: top-p / top-k / min-p sampling or penalties cannot be rescored "
                                  "(the trainer uses the full softmax at T)")
        if temperature is None:
            temperature, first = t, where
        elif t != temperature:
            raise RecordError(f"{where}: temperature {t:g} differs from {temperature:g} at {first}: one file, "
                              "one temperature")
    return (1.0 if temperature is None else float(temperature)), missing


# ---------------------------------------------------------------- batching
def mini_batch_slices(n_groups, size):
    """(start, stop) of ⌊n/size⌋ mini-batches (at least one) over `n_groups` groups, sizes within one."""
    if n_groups <= 0:
        return []
    k = max(1, n_groups // size)
    base, extra = divmod(n_groups, k)  # the first `extra` mini-batches hold one group more
    return [(i * base + min(i, extra), (i + 1) * base + min(i + 1, extra)) for i in range(k)]


def plan_micro_batches(lengths, num_processes, max_tokens, group_by_length=True):
    """Per process, as many micro-batches (index lists into `lengths`, padded within `max_tokens`) as any."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards, load = [[] for _ in range(num_processes)], [0] * num_processes
    for i in order:  # longest first onto the least-loaded process balances the work
        p = min(range(num_processes), key=lambda q: (load[q], q))
        shards[p].append(i)
        load[p] += lengths[i]
    plans = []
    for shard in shards:
        items = shard if group_by_length else sorted(shard)
        mbs, cur, cur_max = [], [], 0
        for i in items:
            new_max = max(cur_max, lengths[i])
            if cur and new_max * (len(cur) + 1) > max_tokens:
                mbs.append(cur)
                cur, new_max = [], lengths[i]
            cur.append(i)
            cur_max = new_max
        if cur:
            mbs.append(cur)
        plans.append(mbs)
    most = max(len(p) for p in plans)
    for p in plans:
        p.extend([] for _ in range(most - len(p)))
    return plans


def collate(trajs, device):
    """Right-padded batch tensors; per-token ones cover positions off..T-1 (off: the shortest prompt)."""
    T = max(t.length for t in trajs)
    off = min(len(t.prompt_ids) for t in trajs)
    B, W = len(trajs), T - off
    input_ids, attention = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, W, dtype=torch.bool)
    adv, old, ref, isw = torch.zeros(B, W), torch.zeros(B, W), torch.zeros(B, W), torch.ones(B, W)
    for b, t in enumerate(trajs):
        P, n = len(t.prompt_ids), len(t.ids)
        input_ids[b, : P + n] = torch.tensor(t.prompt_ids + t.ids)
        attention[b, : P + n] = 1
        s = slice(P - off, P - off + n)
        mask[b, s] = torch.tensor(t.mask, dtype=torch.bool)
        if t.turn_weights is None:
            adv[b, s] = t.weight * t.advantage
        else:  # turn credit: each run of model tokens carries its turn's weight
            for lo, hi, k in t.turn_spans:
                adv[b, P - off + lo : P - off + hi] = t.turn_weights[k] * t.advantage
        if t.old_logprobs is not None:
            old[b, s] = t.old_logprobs
        if t.ref_logprobs is not None:
            ref[b, s] = t.ref_logprobs
        if t.is_weight is not None:
            isw[b, s] = t.is_weight
    batch = {"input_ids": input_ids, "attention_mask": attention, "mask": mask, "adv": adv, "old": old, "ref": ref,
             "isw": isw}
    return {k: v.to(device) for k, v in batch.items()} | {"off": off}


def _chunk_logprobs(head, hidden, targets, temperature, entropy=None, key=0):
    logits = head.forward(hidden)
    if entropy is not None and key not in entropy:  # once: not again where backward recomputes the chunk
        entropy[key] = token_entropy(logits, temperature)
    return token_logprobs(logits, targets, temperature)


def sequence_logprobs(model, input_ids, attention_mask, off, temperature=1.0, mask=None, chunk=LOGPROB_CHUNK,
                      entropy=False):
    """log p (B, T - off) where `mask` is set [and the entropy], `chunk` positions at a time (docs/design.md §6)."""
    T = input_ids.shape[1]
    targets = input_ids[:, off:]
    mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask
    inner = extract_model_from_parallel(model)
    if getattr(inner.config, "final_logit_softcapping", None):
        raise ValueError("sequence_logprobs: models that soft-cap their logits are not supported")
    head = inner.get_output_embeddings()
    hidden = []
    entropies = {} if entropy else None  # chunk start -> its entropies, filled by the chunk's first run

    def keep_hidden(module, args):
        hidden.append(args[0])
        return (args[0][:, :0],)  # the output layer itself projects nothing

    def project(module, args, output):
        h = hidden.pop()[:, :-1][mask]  # (N, H): the model tokens' predecessors
        t = targets[mask]
        # at least one (possibly empty) chunk: every weight joins the loss (DDP waits for every gradient)
        parts, starts = [], range(0, max(len(t), 1), chunk)
        for s in starts:
            piece = (module, h[s : s + chunk], t[s : s + chunk], temperature, entropies, s)
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logprobs, *piece, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(*piece))
        vals = torch.cat(parts)
        if entropies is not None:
            ent = torch.cat([entropies[s] for s in starts])
            entropies["all"] = ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        return vals.new_zeros(mask.shape).masked_scatter(mask, vals)

    # the post-hook first: FSDP2's own sees the log-probs as the output, with the weights still gathered
    handles = [head.register_forward_pre_hook(keep_hidden), head.register_forward_hook(project, prepend=True)]
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T - off + 1, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return (out.logits, entropies["all"]) if entropy else out.logits


def _dummy_forward(model, device):
    # a process with nothing to do in this slot still runs the model: the collectives line up on every process
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.sum() * 0.0


@torch.no_grad()
def score_trajectories(model, micro_batches, device, attr, temperature=1.0):
    """Set `attr` (old_logprobs or ref_logprobs) of each trajectory to its log-probs over ids."""
    for mb in micro_batches:
        if not mb:
            _dummy_forward(model, device)
            continue
        b = collate(mb, device)
        lp = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["off"], temperature, b["mask"]).float().cpu()
        for row, t in zip(lp, mb, strict=True):
            s = len(t.prompt_ids) - b["off"]
            setattr(t, attr, row[s : s + len(t.ids)].clone())


def accumulate_gradients(model, accelerator, micro_batches, norm, clip=0.2, kl_coef=0.0, clip_ratio_c=3.0,
                         temperature=1.0, clip_high=None, level="token", entropy=True):
    """Forward and backward of token_loss over this process's micro-batches of one mini-batch; summed stats."""
    totals = {"pg_sum": 0.0, "kl_sum": 0.0, "clip_count": 0, "dual_clip_count": 0, "tokens": 0, "entropy_sum": 0.0}
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    for k, mb in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        # the accumulation boundary: Accelerate's optimiser wrapper steps only when it is set
        accelerator.sync_gradients = last
        with contextlib.nullcontext() if last or fsdp else accelerator.no_sync(model):
            if not mb:
                accelerator.backward(_dummy_forward(model, accelerator.device))
                continue
            b = collate(mb, accelerator.device)
            out = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["off"], temperature, b["mask"],
                                    entropy=entropy)
            logp, ent = out if entropy else (out, None)
            corrected = any(t.is_weight is not None for t in mb)
            loss, stats = token_loss(logp.float(), b["old"], b["ref"], b["adv"], b["mask"], max(norm, 1), clip, kl_coef,
                                     clip_ratio_c, clip_high, level, b["isw"] if corrected else None)
            stats["entropy_sum"] = torch.where(b["mask"], ent.float(), 0.0).sum().item() if entropy else 0.0
            accelerator.backward(loss * accelerator.num_processes)
        for key in totals:
            totals[key] += stats[key]
    return totals
