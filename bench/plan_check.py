"""The memory plan (common/train/memplan.py) against one measured update step, term by term.

    python bench/plan_check.py --model Qwen/Qwen2.5-3B-Instruct --table T.md            # GPU: the 3B shape whole
    python bench/plan_check.py --model Qwen/Qwen2.5-7B-Instruct --layers 7 --table T.md # 7B shape, 7 of 28 layers
    accelerate launch --config_file configs/accelerate/fsdp_1gpu.yaml bench/plan_check.py ...  # through FSDP2
    python bench/plan_check.py --cpu --table T.md                                       # dry run: small shape, CPU

A model of the shape configs/models/<id>.json gives (random weights: nothing is downloaded;
--layers keeps the first K decoder layers, and the plan is computed for those K), float32 master
weights, the Accelerator train_grpo.py builds (common/train/distributed.py: FSDP2 with bf16 compute
and float32 gradient reduction when launched so), gradient checkpointing unless
--no-gradient-checkpointing, AdamW, and one sequence of --tokens tokens (a BFCL-like mask: 2 of
every 3 blocks of 64 are model tokens) trained by common/train/grpo.py's accumulate_gradients. The
second step is measured (the first creates AdamW's state): memory allocated at marks (before the
step, at the output layer, when backward leaves the output layer, after backward) and the peak
between them, from torch.cuda's allocator statistics on GPU and from the profiler's allocation
events on CPU (exact tensor accounting; RSS is not). Each row adds to the plan's term what the
measured span also holds (named in the row), so a row compares like with like; rows within 15 %
read ok.
Appends the rows to --table (markdown, a header when new) and prints them and one JSON line.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common import presets  # noqa: E402
from common.train import memplan  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=True,
             attention_bias=True, architectures=["Qwen2ForCausalLM"])
TOLERANCE = 0.15
# The plan sums the gradients, the checkpointed activations and the larger transient, an upper
# bound: the log-prob chunk's moment comes before most gradients exist. Its row reads ok when
# the measured peak is not above it (by more than the tolerance).
PEAK = "step peak, without the CUDA overhead term (plan: upper bound)"


def local(t):
    """FSDP2's parameters, gradients and state are DTensors: this process's shard."""
    return t.to_local() if hasattr(t, "to_local") else t


class Memory:
    """Tensor memory at marks, and the peak between consecutive marks. CUDA: the allocator's
    statistics, read at each mark; CPU: the profiler's allocation events, replayed at the end
    (a mark is an allocation of an odd size, found again in the events)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.names, self.level, self.peak = [], {}, {}

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def mark(self, name):
        self.names.append(name)
        if self.cuda:
            torch.cuda.synchronize()
            self.level[name] = torch.cuda.memory_allocated()
            self.peak[name] = torch.cuda.max_memory_allocated()  # since the previous mark
            torch.cuda.reset_peak_memory_stats()
        else:
            torch.empty(1_000_003 + len(self.names), dtype=torch.uint8)

    def __exit__(self, *exc):
        if self.cuda:
            return
        self.prof.__exit__(*exc)
        events = sorted((e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        sizes = {1_000_003 + i + 1: n for i, n in enumerate(self.names)}
        cur = top = 0
        for e in events:
            b = e.nbytes()
            if b in sizes:
                self.level[sizes[b]], self.peak[sizes[b]] = cur, max(top, cur)
                top = cur
            elif -b not in sizes:
                cur += b
                top = max(top, cur)


# configs/models/'s architectures, as transformers names their model types
MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


def build(model_cfg, layers, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in model_cfg.items() if k not in ("source", "parameters", "dtype", "architectures", "model_type")}
    model_type = MODEL_TYPES[model_cfg["architectures"][0]]
    if model_type == "qwen2":
        fields.pop("attention_bias", None)  # Qwen2's q, k, v always have a bias
    config = AutoConfig.for_model(model_type, **(fields | ({"num_hidden_layers": layers} if layers else {})))
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def measure_step(model, tokens, accelerator, checkpointing=True, then=None):
    """Memory of the second of two update steps of `model` (not yet prepared) on one sequence of
    `tokens` tokens. Returns {mark: (level, peak since the previous mark)}, the gradients' and
    AdamW state's bytes on this process. `then(model, optimizer)`, if given, runs last, on the
    prepared pair (the timed save and load)."""
    from common.train.grpo import TrainingSequence, accumulate_gradients

    torch.manual_seed(0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    vocab = inner.config.vocab_size
    ids = torch.randint(0, vocab, (tokens,)).tolist()
    mask = [1 if (i // 64) % 3 != 1 else 0 for i in range(tokens - 1)]
    traj = TrainingSequence("t", 0, ids[:1], ids[1:], mask, [None] * (tokens - 1), 1.0, 1.0, 1.0)
    traj.old_logprobs = traj.ref_logprobs = torch.zeros(tokens - 1)
    model.train()
    mem = None
    hooks = [inner.lm_head.register_forward_pre_hook(lambda *_: mem and mem.mark("output layer")),
             inner.model.norm.register_full_backward_pre_hook(lambda *_: mem and mem.mark("output layer done"))]

    for step in range(2):
        if step == 1:
            mem = Memory(accelerator.device).__enter__()
            mem.mark("start")
        with accelerator.autocast():
            accumulate_gradients(model, accelerator, [[traj]], sum(mask), kl_coef=0.001)
        if mem:
            mem.mark("backward done")
        grads = sum(local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mem.__exit__(None, None, None)
    for h in hooks:
        h.remove()
    state = sum(local(t).nbytes for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    weights = sum(local(p).nbytes for p in model.parameters())
    if then:
        then(model, optimizer)
    return {n: (mem.level[n], mem.peak[n]) for n in mem.names}, weights, grads, state


def save_and_load(folder, model, optimizer, accelerator):
    """One save of what a GPU round hands the next (common/train/checkpoint.py: float32 master weights
    and AdamW's moments, each process its shard) and its load back, timed; the load is checked by
    restoring a tensor zeroed in between. The save's time runs until dcp.save returns (the page
    cache may still hold it), then until os.sync() has written it. The folder is removed after.
    Returns {bytes (this process's shard file), save_s, sync_s, load_s}, or {skipped: why}."""
    from accelerate.utils import broadcast_object_list

    from common.train import checkpoint

    whole = 12 * sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
    skipped = None
    if accelerator.is_main_process:  # one decision for all: a process that skipped would leave the rest in dcp.save
        parent = os.path.dirname(os.path.abspath(folder))
        os.makedirs(parent, exist_ok=True)
        free = shutil.disk_usage(parent).free
        if free < 1.2 * whole:
            skipped = f"{free / memplan.GIB:.1f} GiB free beside {folder}, the state takes {whole / memplan.GIB:.1f} GiB"
        shutil.rmtree(folder, ignore_errors=True)
    skipped = broadcast_object_list([skipped])[0] if accelerator.num_processes > 1 else skipped
    if skipped:
        return {"skipped": skipped}
    t0 = time.perf_counter()
    checkpoint.save(folder, model, optimizer, 2, master=True, world_size=accelerator.num_processes,
                    main=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    save_s = time.perf_counter() - t0
    os.sync()
    accelerator.wait_for_everyone()
    sync_s = time.perf_counter() - t0 - save_s
    shard = os.path.join(folder, f"__{accelerator.process_index}_0.distcp")
    size = os.path.getsize(shard)
    probe = next(p for p in reversed(list(model.parameters())) if p.dim() == 1)  # a norm's weight
    probe = local(probe)
    kept = probe.detach().clone()
    with torch.no_grad():
        probe.zero_()
    t0 = time.perf_counter()
    checkpoint.load(folder, checkpoint.read_info(folder), model, optimizer)
    accelerator.wait_for_everyone()
    load_s = time.perf_counter() - t0
    assert torch.equal(probe, kept), "the load did not restore the saved weights"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
    return {"bytes": size, "save_s": round(save_s, 2), "sync_s": round(sync_s, 2), "load_s": round(load_s, 2)}


def rows(arch, marks, weights, grads, state, tokens, nproc, sharded, on_gpu, checkpointing, chunk):
    """(term, planned bytes, measured bytes) for what one measured step shows."""
    # no vLLM server sleeps beside this process: its residue (the plan's allowance) is not in what is measured
    plan = memplan.train_plan(arch, nproc, sharded, tokens, checkpointing, gpu_mem=2**50, on_gpu=on_gpu, chunk=chunk,
                              server_asleep=False)
    terms = {name.split(" (")[0].split(",")[0]: b for name, b, _ in plan.terms}
    level = {k: v[0] for k, v in marks.items()}
    peak = {k: v[1] for k, v in marks.items()}
    lp, out = arch.layer_params, arch.vocab * arch.hidden
    # What else each measured span holds. Under FSDP2, through forward: the root group (embeddings,
    # output layer) unsharded in the compute dtype, and one decoder layer's unsharded parameters
    # still there when the output layer starts (on CPU processes exactly one layer's float32
    # weights more than without FSDP). The output layer's backward makes the root group's gradient
    # (compute dtype under FSDP2, fp32 without). A layer's backward makes its gradient (fp32
    # without FSDP; under FSDP2 in the compute dtype, upcast on GPU for the fp32 reduce-scatter,
    # next to the layer's gathered weights). The compute dtype: bf16 on GPU, float32 on CPU.
    cb = 2 if on_gpu else 4
    root = cb * (arch.root_params + lp) if sharded else 0
    out_grad = cb * out if sharded else 4 * out
    layer_grad = (2 * cb * lp + (4 * lp if on_gpu else 0)) if sharded else 4 * lp
    act = "activations"
    out_rows = [("weights (fp32)", terms["weights"], weights),
                ("gradients (fp32)", terms["gradients"], grads),
                ("AdamW moments (fp32)", terms["AdamW moments"], state),
                (f"{act} to the output layer" + (" + unsharded root group and one layer" if sharded else ""),
                 terms[act] + root, level["output layer"] - level["start"]),
                ("log-prob chunk + output layer gradient",
                 terms["one log-prob chunk"] + out_grad, peak["output layer done"] - level["output layer"])]
    if checkpointing:
        out_rows.append(("one layer recomputed + its gradient", terms["one layer recomputed in backward"] + layer_grad,
                         peak["backward done"] - level["output layer done"]))
    planned_peak = plan.peak - (memplan.OVERHEAD_GIB * memplan.GIB if on_gpu else 0)
    out_rows.append((PEAK, planned_peak,
                     max(p for _, p in marks.values())))
    return out_rows


def agrees(term, planned, measured):
    if term == PEAK:
        return measured <= (1 + TOLERANCE) * planned
    return abs(measured - planned) <= TOLERANCE * planned


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B-Instruct", help="a configs/models/ id")
    ap.add_argument("--layers", type=int, help="keep this many decoder layers (the plan counts them too)")
    ap.add_argument("--tokens", type=int, default=16384, help="the micro-batch: one sequence (qwen7b: MAX_LEN)")
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run: a small Qwen2 shape on CPU, 512 tokens")
    ap.add_argument("--table", help="markdown file the rows are appended to")
    ap.add_argument("--save-load", metavar="DIR", help="then time one sharded save of the state into DIR (removed after) and its load")
    args = ap.parse_args()
    from common.train import distributed

    accelerator = distributed.make_accelerator(cpu=args.cpu)  # train_grpo.py's, with its defaults
    if args.cpu:
        model_cfg, name, tokens = SMALL, "small Qwen2 (CPU dry run)", min(args.tokens, 512)
    else:
        with open(memplan.arch_path(args.model)) as f:
            model_cfg, name, tokens = json.load(f), args.model, args.tokens
    arch = memplan.read_config_dict(model_cfg)
    if args.layers:
        arch = dataclasses.replace(arch, layers=args.layers)
    t0 = time.perf_counter()
    model = build(model_cfg, args.layers, accelerator.device)
    assert arch.params == sum(p.numel() for p in model.parameters()), "the plan's parameter count is the model's"
    ckpt = not args.no_gradient_checkpointing
    saved = {}
    then = (lambda m, o: saved.update(save_and_load(args.save_load, m, o, accelerator))) if args.save_load else None
    marks, weights, grads, state = measure_step(model, tokens, accelerator, ckpt, then)
    sharded = distributed.sharded(accelerator)
    on_gpu = accelerator.device.type == "cuda"
    table = rows(arch, marks, weights, grads, state, tokens, accelerator.num_processes, sharded, on_gpu, ckpt,
                 presets.LOGPROB_CHUNK)
    if "bytes" in saved:
        # docs/hardware.md §6: 12 bytes a parameter (master + 2 moments), split over the processes;
        # a tied output layer's master copy is written a second time under its own name
        disk = 12 * arch.params + (4 * arch.vocab * arch.hidden if arch.tied else 0)
        table.append(("sharded state on disk, one process's file", disk / accelerator.num_processes, saved["bytes"]))
    shape = f"{name}, {arch.layers} layers{' (of the full model)' if not args.layers else ''}, {tokens} tokens, " \
            f"{'FSDP2' if sharded else 'no FSDP'}, {accelerator.device.type}"
    lines = [f"| {shape} | {term} | {p / memplan.GIB:.3f} | {m / memplan.GIB:.3f} | {m / p:.2f} | "
             f"{'ok' if agrees(term, p, m) else 'OFF'} |" for term, p, m in table]
    if args.table and accelerator.is_main_process:
        new = not os.path.exists(args.table)
        with open(args.table, "a") as f:
            if new:
                f.write("| shape | term | planned GiB | measured GiB | measured / planned | within 15 % |\n"
                        "|---|---|---|---|---|---|\n")
            f.write("\n".join(lines) + "\n")
    accelerator.print("\n".join(lines))
    if saved:
        accelerator.print("sharded state: " + (saved.get("skipped") or (
            f"{saved['bytes'] / memplan.GIB:.3g} GiB a process, saved in {saved['save_s']} s "
            f"(+{saved['sync_s']} s to sync), loaded in {saved['load_s']} s")))
    accelerator.print(json.dumps({"shape": shape, "seconds": round(time.perf_counter() - t0, 1),
                      "rows": [{"term": t, "planned": p, "measured": m} for t, p, m in table],
                      "save_load": saved or None,
                      "reserved_gib": round(torch.cuda.memory_reserved() / memplan.GIB, 2) if on_gpu else None}))
    ok = all(agrees(*row) for row in table)
    del model
    distributed.finish(accelerator)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
