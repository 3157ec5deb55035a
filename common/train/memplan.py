"""Per-GPU memory of the rollout server and of the train stage, from a model's architecture numbers, before
anything loads (docs/hardware.md §8 lists every term and how each was checked).

    python3 -m common.train.memplan [--brief | --host] PRESET [--set VAR=VALUE ...]

prints a preset's plan (`loop.sh PRESET --plan`; --brief: loop.sh's one-line check before round 0; --host: the
node's memory at load) and exits 3 when a stage does not fit, naming the variable to change. MODEL's numbers
come from configs/models/<hub id>.json or a model folder's config.json. Standard library only (a fresh clone).
"""

from __future__ import annotations  # `float | None` below, on a system python3 older than 3.10

import argparse
import dataclasses
import json
import os
import sys

from common import presets
from common.presets import LOGPROB_CHUNK, LORA_RANK

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30
MARGIN = 0.10  # of GPU memory kept free: fragmentation and what the plan does not count
OVERHEAD_GIB = 3.0  # CUDA context (~0.5), NCCL buffers (~1), caching-allocator slack
VLLM_UTILIZATION = 0.9  # the policy's server's (common/engine/serve.py command()), not vLLM's default 0.92
VLLM_CUDA_CONTEXT_GIB = 0.5  # each vLLM process's, outside its share (created before vLLM's snapshot)
VLLM_BATCHED_TOKENS = 8192  # vLLM serve's default max_num_batched_tokens on large GPUs
VLLM_CONTEXT_GIB = 2.0  # CUDA context and CUDA graphs of a vLLM replica
VLLM_ASLEEP_GIB = 3.0  # what a vLLM server asleep at level 2 keeps on a GPU: an allowance (hardware.md §8)
USER_UTILIZATION = 0.08  # a served USER_MODEL's share of the first GPU, beside the policy's server
RECOMPUTE = 1.1  # a recomputed layer in backward, over its activations: measured on CPU (tests/test_memplan.py)


class PlanError(Exception):
    """A model whose architecture numbers cannot be read, or a setting that makes no sense."""


@dataclasses.dataclass(frozen=True)
class Arch:
    """The architecture numbers the plan needs (a decoder-only Qwen2/Qwen3/Llama model)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    bias: bool  # biases on q, k, v (Qwen2)
    max_pos: int
    qk_norm: bool = False  # an RMSNorm over each head of q and of k (Qwen3)

    @property
    def layer_params(self):
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (d * q + 2 * d * kv + q * d + 3 * d * self.ffn + 2 * d + ((q + 2 * kv) if self.bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))

    @property
    def root_params(self):
        """Embeddings, final norm and output layer: FSDP's root group, outside the decoder layers."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self):
        return self.layers * self.layer_params + self.root_params

    @property
    def kv_bytes_per_token(self):
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


def read_config(path):
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read the architecture numbers ({e})") from None
    return read_config_dict(c, path)


def read_config_dict(c, path="config"):
    """Arch from a config.json's fields (or configs/models/'s, which add the parameter count)."""
    c = c.get("text_config", c)
    try:
        arch = Arch(
            hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]), heads=int(c["num_attention_heads"]),
            kv_heads=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
            ffn=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            # Qwen2's config has no attention_bias field: its q, k, v projections always have one
            bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2"
                            or "Qwen2ForCausalLM" in (c.get("architectures") or []))),
            max_pos=int(c.get("max_position_embeddings") or 0),
            qk_norm=c.get("model_type") == "qwen3" or "Qwen3ForCausalLM" in (c.get("architectures") or []),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{path}: cannot read the architecture numbers (missing or bad {e})") from None
    stated = c.get("parameters")
    if stated is not None and stated != arch.params:
        raise PlanError(f"{path}: the numbers give {arch.params} parameters, the file states {stated}")
    return arch


def arch_path(model):
    """The file the numbers of `model` (a model folder or a hub id) are read from."""
    if os.path.isdir(model):
        return os.path.join(model, "config.json")
    return os.path.join(ROOT, "configs", "models", f"{model}.json")


def load_arch(model):
    path = arch_path(model)
    if not os.path.isfile(path):
        raise PlanError(f"no architecture numbers for {model}: {path} does not exist (add the model's "
                        "config.json fields there, as configs/models/Qwen/Qwen2.5-7B-Instruct.json has them)")
    return read_config(path)


# ---------------------------------------------------------------- terms
def layer_activation_bytes(arch, a):
    """Bytes one decoder layer keeps for backward, per token, in compute dtype of `a` bytes."""
    norms = 2 * (4 + 2 * a) * arch.hidden
    attention = a * (2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim + 4 * arch.heads
    if arch.qk_norm:  # each head's norm of q and k: its float32 input and normalised output (RoPE keeps neither)
        attention += (4 + a) * (arch.heads + arch.kv_heads) * arch.head_dim
    mlp = 4 * a * arch.ffn
    return norms + attention + mlp


def trunk_extra_bytes(arch, a):
    """Per token, outside the decoder layers: the final norm and the RoPE tables."""
    return (4 + 2 * a) * arch.hidden + 2 * arch.head_dim * a


def reduce_scatter_input(arch):
    """FSDP2's float32 reduce-scatter input of the largest FSDP group (a decoder layer or the root), in
    bytes: one buffer as large as the group's unsharded gradients (docs/hardware.md §8)."""
    return 4 * max(arch.layer_params, arch.root_params)


def server_len(max_len, eval_len, model_len):
    """The context loop.sh serves (vLLM's max_model_len): the longer of MAX_LEN and EVAL_LEN (else the
    model's own)."""
    return max(int(max_len), int(eval_len or model_len))


def chunk_bytes(arch, positions, a):
    """One log-prob chunk in backward (grpo.py recomputes it): float32 logits and their gradient (8 bytes an
    entry; measured 7.0 on CPU, the log-softmax freed as it goes); in a narrower compute dtype also the logits
    in it and their float32 copy (14 bytes an entry in bf16)."""
    return positions * arch.vocab * (8 + (a + 4 if a < 4 else 0))


@dataclasses.dataclass
class Plan:
    title: str
    terms: list  # (name, bytes, transient): the transient ones happen at different moments
    limit: float  # bytes the stage may use
    contexts: float | None = None  # the rollout server's: full MAX_LEN contexts its KV cache holds

    @property
    def peak(self):
        steady = sum(b for _, b, t in self.terms if not t)
        return steady + max((b for _, b, t in self.terms if t), default=0)

    @property
    def fits(self):
        return self.peak <= self.limit


def train_plan(arch, nproc, sharded, tokens, checkpointing, gpu_mem, on_gpu=True, lora=False,
               chunk=LOGPROB_CHUNK, server_asleep=True):
    """Per-GPU memory of one train_grpo.py update step. sharded: FSDP2 over `nproc`
    processes (else each holds everything, DDP); tokens: of the largest micro-batch;
    server_asleep: a vLLM server sleeps on the same GPUs (loop.sh's GPU presets), on GPUs only."""
    a = 2 if on_gpu else 4
    n = nproc if sharded else 1
    P = arch.params
    terms = []
    if lora:
        d, q, kv, f = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.ffn
        adapter = arch.layers * LORA_RANK * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
        terms += [(f"frozen base weights ({'bf16' if on_gpu else 'fp32'}{shard(n)})", a * P / n, False),
                  (f"adapter weights, gradients and AdamW (fp32{shard(n)})", 16 * adapter / n, False)]
    else:
        terms += [(f"weights (fp32{shard(n)})", 4 * P / n, False),
                  (f"gradients (fp32{shard(n)})", 4 * P / n, False),
                  (f"AdamW moments (fp32{shard(n)})", 8 * P / n, False)]
    layer = layer_activation_bytes(arch, a) * tokens
    extra = trunk_extra_bytes(arch, a) * tokens
    if checkpointing:
        terms += [(f"activations, checkpointed ({arch.layers} layer inputs x {tokens} tokens)",
                   arch.layers * a * arch.hidden * tokens + extra, False),
                  ("one layer recomputed in backward, with its gradients", RECOMPUTE * layer, True)]
    else:
        terms.append((f"activations, no checkpointing ({arch.layers} layers x {tokens} tokens)",
                      arch.layers * layer + extra, False))
    terms.append((f"one log-prob chunk ({min(chunk, tokens)} positions x {arch.vocab} vocabulary)",
                  chunk_bytes(arch, min(chunk, tokens), a), True))
    if sharded:
        lp, rp = arch.layer_params, arch.root_params
        terms += [("FSDP all-gathered: 2 layers bf16, root group bf16 + grad", 2 * 2 * lp + 2 * 2 * rp, False),
                  ("FSDP2 reduce-scatter input (fp32) of the largest group, "
                   + ("the root: embeddings + output layer" if rp > lp else "one layer"), reduce_scatter_input(arch), False)]
    elif nproc > 1:
        terms.append(("DDP gradient buckets (fp32)", 4 * P, False))
    if on_gpu:
        terms += [OVERHEAD, ASLEEP] if server_asleep else [OVERHEAD]
    mode = ("FSDP over " if sharded else "DDP, " if nproc > 1 else "") + f"{nproc} process{'es' * (nproc > 1)}"
    ckpt = "gradient checkpointing" if checkpointing else "no gradient checkpointing"
    return Plan(f"train stage ({mode}, {ckpt}, micro-batch of {tokens} tokens)", sort(terms),
                (1 - MARGIN) * gpu_mem)


def reference_plan(arch, tokens, gpu_mem, chunk=LOGPROB_CHUNK):
    """train_grpo.py's reference pass on GPUs: the whole reference model in bf16 on each, no gradients."""
    # no-grad forward: a layer's widest tensors (the MLP's three) and the residual stream, in bf16
    forward = 2 * (3 * arch.ffn + 3 * arch.hidden) * tokens
    terms = [("reference weights (bf16, whole)", 2 * arch.params, False),
             ("forward without gradients (one layer at a time)", forward, False),
             ("one log-prob chunk", min(chunk, tokens) * arch.vocab * (8 + 2), False), OVERHEAD, ASLEEP]
    return Plan("reference pass (before the policy loads)", sort(terms), (1 - MARGIN) * gpu_mem)


OVERHEAD = ("CUDA context, NCCL buffers, allocator slack (estimate)", OVERHEAD_GIB * GIB, False)
ASLEEP = ("sleeping vLLM server: CUDA context, CUDA-graph pool, allocator residue (allowance)", VLLM_ASLEEP_GIB * GIB, False)


def rollout_plan(arch, tp, gpu_mem, max_len, rollout_len=None, utilization=VLLM_UTILIZATION, title=None):
    """One vLLM replica over `tp` GPUs, per GPU, serving contexts of `max_len` (its max_model_len;
    rollouts stop at `rollout_len`) in `utilization` of each GPU; the KV cache takes what is left."""
    budget = utilization * gpu_mem
    weights = 2 * arch.params / tp
    # vLLM's profiling pass: the MLP's widest tensors over its batched tokens, and sampling's logits
    activations = VLLM_BATCHED_TOKENS * 2 * (3 * arch.ffn + 4 * arch.hidden) / tp + 256 * arch.vocab * 4
    fixed = VLLM_CONTEXT_GIB * GIB
    kv = budget - weights - activations - fixed
    per_token = arch.kv_bytes_per_token / tp
    contexts = kv / (per_token * max_len) if kv > 0 else 0.0
    terms = sort([("weights (bf16)", weights, False), (f"activations at {VLLM_BATCHED_TOKENS} batched tokens", activations, False),
                  ("CUDA context and graphs", fixed, False)])
    rollouts = ""
    if rollout_len and rollout_len != max_len:
        rollouts = f", {contexts * max_len / rollout_len:.1f} rollouts of MAX_LEN={rollout_len}"
    terms.append((f"KV cache: {max(kv, 0) / per_token / 1e6:.2f} M tokens of {per_token / 1024:.0f} KiB"
                  f" = {contexts:.1f} contexts of max_model_len={max_len}{rollouts}", max(kv, 0), False))
    return Plan(title or f"rollout server (vLLM, TP {tp}, gpu_memory_utilization {utilization})", terms, budget,
                contexts)


def user_serve_args(max_len):
    """The serve arguments loop.sh gives a USER_MODEL server on GPUs: the share and context planned."""
    return f"--gpu-memory-utilization {USER_UTILIZATION} --max-model-len {max_len}"


def first_gpu_plan(gpu_mem):
    """The first GPU while a stage plays against a USER_MODEL served beside the policy: both servers'
    shares and their CUDA contexts. The user's server starts second and needs its whole share free
    at its snapshot, so this must fit the GPU whole (no margin: vLLM's shares are its budgets)."""
    ctx = VLLM_CUDA_CONTEXT_GIB * GIB
    return Plan("first GPU while a stage plays: the policy's and the user simulator's vLLM servers", [
        (f"policy's server: gpu_memory_utilization {VLLM_UTILIZATION}", VLLM_UTILIZATION * gpu_mem, False),
        (f"user simulator's server: gpu_memory_utilization {USER_UTILIZATION}", USER_UTILIZATION * gpu_mem, False),
        ("policy's server: CUDA context, outside its share", ctx, False),
        ("user simulator's server: CUDA context, outside its share", ctx, False)], gpu_mem)


def shard(n):
    return f", 1/{n}" if n > 1 else ""


def sort(terms):
    return sorted(terms, key=lambda t: -t[1])


def render(plan, gpu_mem):
    lines = [f"{plan.title}:"] + [f"  {b / GIB:7.2f} GiB  {name}{'  *' if transient else ''}"
                                  for name, b, transient in plan.terms]
    if any(t for *_, t in plan.terms):
        lines.append("           (* at different moments: the larger one counts)")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  {plan.peak / GIB:7.2f} GiB  peak of {gpu_mem / GIB:.0f} GiB "
                 f"(limit {plan.limit / GIB:.1f}): {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------- loop.sh's view
def settings_plans(p):
    """The plans of a resolved preset `p` (common.presets.Preset): rollout, reference, train."""
    arch = load_arch(p.model)
    try:
        nproc, tp, gpu_mem = int(p.nproc or 1), int(p.tp or 1), float(p.gpu_mem_gib) * GIB
        max_len, micro, eval_len = int(p.max_len), int(p.micro_tokens), int(p.eval_len or 0)
    except ValueError as e:
        raise PlanError(f"NPROC, TP, GPU_MEM_GIB, MAX_LEN, MICRO_TOKENS and EVAL_LEN must be numbers ({e})") from None
    if not eval_len and not arch.max_pos:
        raise PlanError(f"{arch_path(p.model)} has no max_position_embeddings: the server's context is "
                        "unknown (set EVAL_LEN)")
    serve = server_len(max_len, eval_len, arch.max_pos)
    sharded = p.sharded  # FSDP on one GPU too: its bf16 copies and float32 reduce-scatter are there all the same
    ckpt = "--gradient-checkpointing" in p.extra_train.split()
    lora = "--lora" in p.lora.split()
    tokens, chunk = max(micro, max_len), LOGPROB_CHUNK
    user = None
    if served_user(p):  # on the first GPU beside the policy's server while a stage plays
        user = rollout_plan(load_arch(p.user_model), 1, gpu_mem, max_len, utilization=USER_UTILIZATION,
                            title="user simulator server (vLLM, USER_MODEL, gpu_memory_utilization "
                                  f"{USER_UTILIZATION})")
    train = train_plan(arch, nproc, sharded, tokens, ckpt, gpu_mem, lora=lora, chunk=chunk)
    return arch, {
        "rollout": rollout_plan(arch, tp, gpu_mem, serve, max_len),
        "reference": reference_plan(arch, tokens, gpu_mem, chunk=chunk),
        "train": train,
        "full": train_plan(arch, nproc, sharded, tokens, ckpt, gpu_mem, chunk=chunk) if lora else train,
        "user": user,
        "first_gpu": first_gpu_plan(gpu_mem) if user else None,
    }, dict(nproc=nproc, sharded=sharded, ckpt=ckpt, lora=lora, gpu_mem=gpu_mem, max_len=max_len,
            micro=micro, chunk=chunk, serve=serve, eval_len=eval_len)


def served_user(p):
    """Whether a stage serves USER_MODEL here, as a user simulator: the environment's or an OOD bench's flags
    name it (common/presets.py env_shell)."""
    from common.presets import env_shell
    return bool(p.user_model) and any("--user-model" in v for v in env_shell(p).values() if isinstance(v, list))


def advice(arch, k):
    """What to change in loop.sh's variables so that the train stage fits, as phrases."""
    def fits(nproc=None, tokens=None, ckpt=None, lora=None):
        return train_plan(
            arch, nproc or k["nproc"], k["sharded"], tokens or max(k["micro"], k["max_len"]),
            k["ckpt"] if ckpt is None else ckpt, k["gpu_mem"], lora=k["lora"] if lora is None else lora,
        ).fits

    out = []
    if not k["ckpt"] and fits(ckpt=True):
        out.append("add --gradient-checkpointing to EXTRA_TRAIN")
    if k["micro"] > k["max_len"]:
        best = max((t for t in range(k["max_len"], k["micro"], 1024) if fits(tokens=t)), default=None)
        if best:
            out.append(f"lower MICRO_TOKENS to {best} or less")
    else:
        best = max((t for t in range(1024, k["max_len"], 1024) if fits(tokens=t)), default=None)
        if best:
            out.append(f"lower MAX_LEN to {best} (a micro-batch holds at least one whole sequence)")
    if k["sharded"]:
        more = next((n for n in (2 * k["nproc"], 4 * k["nproc"]) if n <= 8 and fits(nproc=n)), None)
        if more:
            out.append(f"GPUS={more} (the weights sharded over {more} GPUs)")
    if not k["lora"] and fits(lora=True):
        out.append(f"LORA=--lora (a rank-{LORA_RANK} adapter through PEFT, the base weights frozen in bf16, "
                   f"trained at lr {presets.LR_LORA} unless LR is set)")
    return out or ["use GPUs with more memory (GPU_MEM_GIB)"]


def host_load_bytes(arch, nproc, lora):
    """Host memory while the training processes load the policy: each holds its own whole copy (the
    reference model is built by each too, but in bf16 and freed before the policy loads)."""
    return nproc * (2 if lora else 4) * arch.params


def available_bytes(meminfo="/proc/meminfo"):
    """This machine's available memory (MemAvailable), or None where /proc/meminfo does not say."""
    try:
        with open(meminfo) as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def host_check(arch, k, meminfo="/proc/meminfo"):
    """None, or why the training processes' load does not fit this machine's memory."""
    need, have = host_load_bytes(arch, k["nproc"], k["lora"]), available_bytes(meminfo)
    if have is None or need <= have:
        return None
    fix = "run on a node with more memory" + ("" if k["lora"] else ", or LORA=--lora (a bf16 base: half the load)")
    return (f"the {k['nproc']} training processes load the policy whole before sharding it: "
            f"{need / GIB:.1f} GiB of host memory, and this machine has {have / GIB:.1f} GiB available "
            f"(MemAvailable): {fix}")


def training(p):
    """What is trained and at which learning rate, as words."""
    return f"{'LoRA rank ' + str(LORA_RANK) if p.lora else 'full fine-tuning'} at lr {p.lr}"


def served_from(k, arch):
    """Where the server's context comes from, as words."""
    if k["serve"] == k["max_len"]:
        return "MAX_LEN"
    return "EVAL_LEN" if k["eval_len"] else f"the model's own, max_position_embeddings={arch.max_pos}"


def main(argv):
    parser = argparse.ArgumentParser(prog="python3 -m common.train.memplan", description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", help=", ".join(presets.PRESETS))
    parser.add_argument("--set", action="append", default=[], metavar="VAR=VALUE", help="override one preset variable")
    parser.add_argument("--brief", action="store_true", help="one line (loop.sh's check before round 0)")
    parser.add_argument("--host", action="store_true",
                        help="only whether the training processes' load fits this machine's memory (loop.sh, on the node)")
    a = parser.parse_args(argv)
    try:
        p = presets.resolve(a.preset, a.set, presets.visible_gpus())
        arch, plans, k = settings_plans(p)
    except (presets.PresetError, PlanError) as e:
        sys.exit(f"memplan: {e}")
    if a.host:
        host = host_check(arch, k)
        sys.exit(f"memplan: {host}" if host else 0)
    rollout, reference, train, user = plans["rollout"], plans["reference"], plans["train"], plans["user"]
    first = plans["first_gpu"]
    ok = rollout.fits and rollout.contexts >= 1 and reference.fits and train.fits and (
        user is None or (user.fits and user.contexts >= 1 and first.fits))
    if not a.brief:
        print(f"memory plan: {a.preset} {p.model} ({arch.params / 1e9:.2f} B parameters, "
              f"{arch.layers} layers), {k['nproc']} GPU{'s' * (k['nproc'] > 1)} x {p.gpu_mem_gib} GiB, rollouts MAX_LEN={k['max_len']},"
              f" server max_model_len={k['serve']} ({served_from(k, arch)}), MICRO_TOKENS={k['micro']},"
              f" log-prob chunk {k['chunk']}, margin {MARGIN:.0%}, {training(p)}")
        if k["max_len"] < k["serve"]:
            print(f"training context MAX_LEN={k['max_len']} is shorter than evaluation's {k['serve']} "
                  f"({served_from(k, arch)}): a rollout that fills it ends as context_limit where evaluation "
                  "would have gone on")
        for plan in (rollout, reference, train) + ((user, first) if user else ()):
            print(render(plan, k["gpu_mem"]))
        print(f"host memory at load: {k['nproc']} process{'es' * (k['nproc'] > 1)} x "
              f"{host_load_bytes(arch, 1, k['lora']) / GIB:.2f} GiB ({'bf16 base' if k['lora'] else 'float32 policy'}"
              f", loaded whole before sharding) = {host_load_bytes(arch, k['nproc'], k['lora']) / GIB:.2f} GiB")
        if k["lora"]:
            full = plans["full"]
            print(f"full fine-tuning instead of LoRA: {full.peak / GIB:.2f} GiB per GPU of {p.gpu_mem_gib}: "
                  + ("fits" if full.fits else "DOES NOT FIT"))
    else:
        print(f"memory plan: rollout server {rollout.contexts:.0f} contexts of max_model_len={k['serve']} per replica, train stage "
              f"{train.peak / GIB:.1f} GiB and reference pass {reference.peak / GIB:.1f} GiB per GPU of "
              f"{p.gpu_mem_gib}, {training(p)}"
              + (f", user simulator {user.contexts:.1f} contexts of MAX_LEN beside it" if user else "")
              + " (bash loop.sh PRESET --plan for the terms)")
    if user is not None and not (user.fits and user.contexts >= 1):
        print(f"memplan: the user simulator USER_MODEL={p.user_model} needs "
              f"{(user.peak - user.terms[-1][1]) / GIB:.1f} GiB and one context of MAX_LEN={k['max_len']} beside the "
              f"policy's server, which leaves it {user.limit / GIB:.1f} GiB of the first GPU (gpu_memory_utilization "
              f"{USER_UTILIZATION}): serve it on other GPUs or another node and name it with USER_BASE_URL and "
              f"USER_MODEL_NAME", file=sys.stderr)
    if first is not None and not first.fits:
        print(f"memplan: the policy's and the user simulator's vLLM servers need {first.peak / GIB:.1f} GiB of the "
              f"first GPU with their CUDA contexts, and it has {p.gpu_mem_gib} GiB: serve USER_MODEL on other GPUs "
              f"or another node and name it with USER_BASE_URL and USER_MODEL_NAME", file=sys.stderr)
    if rollout.contexts < 1:
        print(f"memplan: the rollout server's KV cache holds {rollout.contexts:.2f} contexts of its max_model_len="
              f"{k['serve']} ({served_from(k, arch)}), and vLLM does not start below one: lower "
              f"{'MAX_LEN' if k['serve'] == k['max_len'] else 'EVAL_LEN'} or raise TP (or GPU_MEM_GIB)", file=sys.stderr)
    if not reference.fits:
        print(f"memplan: the reference pass needs {reference.peak / GIB:.1f} GiB per GPU of GPU_MEM_GIB="
              f"{p.gpu_mem_gib}: lower MAX_LEN or use LORA=--lora", file=sys.stderr)
    if not train.fits:
        print(f"memplan: the train stage needs {train.peak / GIB:.1f} GiB per GPU, over the limit of "
              f"{train.limit / GIB:.1f} GiB (GPU_MEM_GIB={p.gpu_mem_gib} less {MARGIN:.0%}): "
              + "; or ".join(advice(arch, k)), file=sys.stderr)
    sys.exit(0 if ok else 3)


if __name__ == "__main__":
    main(sys.argv[1:])
