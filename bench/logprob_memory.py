"""Peak memory of the log-prob pass: the full-logits computation it replaced vs the chunked one
(common/grpo.py sequence_logprobs, LOGPROB_CHUNK positions at a time, model tokens only).

    python bench/logprob_memory.py [--lengths 2048 4096 8192] [--vocab 32768] [--model-share 0.5]

One sequence of each length through a one-layer float32 Qwen2 on CPU whose vocabulary
dominates (hidden 64, --vocab entries, untied; "body" is the model without its output layer,
whose attention backward on CPU grows with the length squared), an eighth of it prompt and --model-share of the
rest model tokens (mask 1; the others stand for tool results and user turns). Each cell runs in
a fresh process and reports its peak resident memory above the same process's baseline (model
built, a short warm-up run): torch's CPU allocator returns large blocks to the OS, so the
high-water mark of the resident set is the pass's peak. "score" is the no-grad pass (old and
reference log-probs), "train" forward + backward of the summed log-probs. The last column is
one float32 copy of the full logits block: the old pass held about one (score) and three
(train) of them, the chunked one a few LOGPROB_CHUNK x vocabulary blocks whatever the length.
"""

import argparse
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.grpo import LOGPROB_CHUNK, sequence_logprobs  # noqa: E402


def old_logprobs(model, input_ids, attention_mask, off):
    """The pass before chunking: logits for every position after the prompt, then the log-softmax."""
    T = input_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T - off + 1).logits[:, :-1]
    targets = input_ids[:, off:]
    return -F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)


def inputs(length, vocab, model_share):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, length), generator=gen)
    off = length // 8
    # alternating spans of 64 tokens: model turns (mask 1) and tool results / user turns (mask 0)
    span = torch.arange(length - off) // 64
    mask = (span % round(1 / model_share) == 0)[None] if model_share < 1 else torch.ones(1, length - off, dtype=torch.bool)
    return ids, torch.ones_like(ids), off, mask


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def cell(impl, mode, length, vocab, model_share):
    """Peak bytes above the baseline of one pass, in this process."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=max(length, 64), tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)

    def run(ids, attention, off, mask):
        with torch.set_grad_enabled(mode == "train"):
            if impl == "body":  # the model without any vocabulary projection: what both share
                hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
                if mode == "train":
                    hidden.sum().backward()
                return
            if impl == "old":
                lp = old_logprobs(model, ids, attention, off)
            else:
                lp = sequence_logprobs(model, ids, attention, off, mask=mask)
            if mode == "train":
                torch.where(mask, lp, 0.0).sum().backward()
        model.zero_grad(set_to_none=True)

    run(*inputs(64, vocab, model_share))  # warm-up: kernels, allocator, autograd
    batch = inputs(length, vocab, model_share)
    base = peak_rss()
    run(*batch)
    return peak_rss() - base


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--model-share", type=float, default=0.5, help="share of the positions after the prompt with mask 1")
    ap.add_argument("--cell", nargs=3, help=argparse.SUPPRESS)  # impl mode length: one measurement, in a child
    args = ap.parse_args()
    if args.cell:
        impl, mode, length = args.cell
        print(cell(impl, mode, int(length), args.vocab, args.model_share))
        return
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    mib = 2**20
    print(f"vocabulary {args.vocab}, LOGPROB_CHUNK {LOGPROB_CHUNK}, model-token share {args.model_share}; "
          "peak MiB above baseline")
    print(f"{'length':>7}" + "".join(f"{m + ' ' + i:>12}" for m in ("score", "train") for i in ("body", "old", "new"))
          + f"{'1 copy':>8}")
    for length in args.lengths:
        row = []
        for mode in ("score", "train"):
            for impl in ("body", "old", "new"):
                out = subprocess.run(
                    [sys.executable, __file__, "--vocab", str(args.vocab), "--model-share", str(args.model_share),
                     "--cell", impl, mode, str(length)],
                    env=env, check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                row.append(int(out.split()[-1]) / mib)
        copy = (length - length // 8) * args.vocab * 4 / mib
        print(f"{length:>7}" + "".join(f"{v:>12.0f}" for v in row) + f"{copy:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
