#!/usr/bin/env bash
# The GPU check: one short script for a bare single-GPU machine (H100/H200 class, with torch,
# transformers, accelerate and peft preinstalled, no vLLM, no internet).
#
#   bash bench/gpu_check.sh --prepare        # here, first: wheels the GPU machine lacks -> .wheels/, and
#                                            # the training steps' inputs -> .gpu-inputs/
#   bash bench/gpu_check.sh OUTDIR           # there (.wheels/ and .gpu-inputs/ carried along): <= 8 min
#   bash bench/gpu_check.sh OUTDIR --cpu     # dry run on CPU, small sizes, the same steps
#
# Steps, each timed and allowed to fail on its own (the table says which did), in the order of what
# they decide, all within GPU_CHECK_BUDGET seconds (470; a step gets what is left, the rest are skipped):
#   1. bench/plan_check.py: the memory plan (common/train/memplan.py) term by term against one measured
#      update step through one-process FSDP2, 16384 tokens, random weights at the presets' shapes
#      (configs/models/): Qwen2.5-3B whole, Qwen2.5-7B with 7 of its 28 layers, then one sharded save
#      of its state (float32 master weights and AdamW's moments, common/train/checkpoint.py, 33 GB) and its
#      load, timed, and Qwen3-4B with 9 of its 36 layers (dry run: a small Qwen2, FSDP2 on two CPU
#      processes). torch, transformers and accelerate only: nothing of bfcl-eval.
#   2. install bfcl-eval and what the machine lacks of what it imports from .wheels/ into .gpu-site/
#   3. train_grpo.py through `accelerate launch` with the one-process FSDP2 config, on the prepared
#      tiny-model rollouts (groups of mixed rewards, so a step moves the weights): a LoRA adapter on
#      the bf16 base with bf16 mixed precision, two rounds, the second continuing the first's
#      optimiser state; then full fine-tuning, with the dtypes gradients were accumulated and reduced
#      in (dry run: FSDP2 on two CPU processes)
#   4. tests/fsdp_bf16_probe.py: FSDP2 with bf16 mixed precision: the log-probs the loss uses are
#      float32, equal to a float32 log-softmax of the bf16 logits
#   5. bench/update_throughput.py: Qwen2.5-3B-sized random model, gradient checkpointing,
#      8 sequences of 8k tokens: tokens/s, peak GPU memory, MFU (989 TFLOP/s dense bf16); then
#      the presets' objective (entropy, rollout correction) against the paper's, 4 sequences
#   6. the stages on CUDA, last: rollout.py --engine hf (the tiny preset's tasks, 4 samples each,
#      through Ω_0), evaluate.py --split all --engine hf (the first 2 tasks of each category of the 800
#      the BFCL leaderboard scores; dry run: 1), diagnose.py
# Writes OUTDIR/gpu_check.md (the table, then the plan check's rows) and OUTDIR/logs.tar.gz (every
# step's log and output): two files, whatever a machine that returns few files sends back.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
# bfcl-eval and what its modules import that the GPU image lacks (found by running the dry run
# on that image's torch 2.11, transformers 5.17 and accelerate 1.15 with its package list), at the
# versions setup.sh installs here; five are compiled, so all are fetched for the GPU machine's
# Python (GPU_PYTHON). The install step takes only those the machine does not have. The second
# line is for evaluate.py: bfcl-eval's model registry, which names its result files, imports every
# provider's SDK (found as the modules an --engine hf evaluation loads, less the image's packages).
GPU_PYTHON=${GPU_PYTHON:-3.12}
WHEELS=(bfcl-eval tree-sitter tree-sitter-java tree-sitter-javascript openai httpx2 httpcore2 truststore jiter
        pydantic pydantic-core annotated-types typing-inspection sniffio tenacity overrides filelock mpmath tqdm
        anthropic black boto3 botocore cffi cohere cryptography dashscope datamodel-code-generator distro
        docstring-parser fastavro google-auth google-genai httpx-sse inflect isort jmespath json5 mistralai
        opentelemetry-api platformdirs python-dotenv pytokens qwen-agent s3transfer soundfile websocket-client
        websockets writer-sdk)

if [ "${1:-}" = --prepare ]; then
  pins=$($PY -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
         "${WHEELS[@]}") || { echo "gpu_check: run setup.sh first: the pins are the versions it installs" >&2; exit 1; }
  rm -rf .wheels && mkdir -p .wheels
  # shellcheck disable=SC2086
  $PY -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: -d .wheels \
    --python-version "$GPU_PYTHON" --implementation cp --abi "cp${GPU_PYTHON/./}" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $pins || exit 1
  # The training steps' inputs: the tiny preset's model and one round of its rollouts (its 8 tasks, 4
  # samples each, temperature 1), diagnosed. Made here, so that the GPU machine trains before it has
  # played anything, on groups whose rewards differ (a group of equal rewards has no advantage, and
  # a step on such groups alone moves nothing).
  rm -rf .gpu-inputs && mkdir -p .gpu-inputs
  cp -r "$($PY -c 'from common.run.tiny import build_cached; print(build_cached())')" .gpu-inputs/model || exit 1
  $PY evolve.py --out .gpu-inputs/interface.json > /dev/null || exit 1
  for seed in 0 1 2 3; do
    $PY rollout.py --model .gpu-inputs/model --tasks data/tiny.jsonl --n 4 --temperature 1 --seed "$seed" \
      --interface .gpu-inputs/interface.json --max-new-tokens 96 --max-steps-per-turn 3 --engine hf \
      --out .gpu-inputs/rollouts.jsonl > /dev/null &&
    $PY diagnose.py --tasks data/tiny.jsonl --rollouts .gpu-inputs/rollouts.jsonl --out .gpu-inputs/diagnoses.jsonl \
      > /dev/null || exit 1
    mixed=$($PY -c "import json, sys, collections; g = collections.defaultdict(set)
for line in open(sys.argv[1]): d = json.loads(line); g[d['task_id']].add(d['reward'])
print(sum(len(r) > 1 for r in g.values()))" .gpu-inputs/diagnoses.jsonl)
    [ "$mixed" -ge 2 ] && break
  done
  [ "$mixed" -ge 2 ] || { echo "gpu_check: the tiny model's rollouts hold $mixed groups of mixed rewards in 4 seeds" >&2; exit 1; }
  du -sh .wheels .gpu-inputs; echo "gpu_check: $mixed of 8 groups with mixed rewards"
  exit
fi
[ $# -ge 1 ] || { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ -f .gpu-inputs/diagnoses.jsonl ] || { echo "gpu_check: no .gpu-inputs/ (bash bench/gpu_check.sh --prepare, here first)" >&2; exit 2; }
OUT=$(realpath -m "$1"); DRY=${2:-}
mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # every step's log and output; archived into OUT at the end
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = --cpu ]; then
  export CUDA_VISIBLE_DEVICES=""
  N=2; TPUT=(--cpu --config small --seqs 2 --seq-len 512); FSDP=(--config_file configs/accelerate/fsdp_cpu.yaml)
  CPU=(--cpu); TASK_ARGS=(--limit 1); MAX_NEW=32; PER_CATEGORY=1
  BF16_CPU=(--mixed_precision bf16)  # the LoRA step as on GPUs: a bf16 base, bf16 compute (float32 is the CPU default)
else
  N=4; TPUT=(); FSDP=(--config_file configs/accelerate/fsdp_1gpu.yaml); CPU=(); TASK_ARGS=(); MAX_NEW=96; PER_CATEGORY=2
  BF16_CPU=()
fi
TABLE=$OUT/gpu_check.md
printf '| step | status | seconds | figures |\n|---|---|---|---|\n' > "$TABLE"

# step NAME FIGURES_CMD -- CMD...: run CMD (log in W/NAME.log), then add a row with FIGURES_CMD's output.
# The whole check keeps to BUDGET seconds (a GPU machine's minutes may be few): a step gets what is
# left, and once nothing is, the rest are skipped, each with a row that says so.
BUDGET=${GPU_CHECK_BUDGET:-470}
step() {
  local name=$1 figures=$2; shift 3
  local t0=$SECONDS status=ok left=$((BUDGET - SECONDS))
  if [ $left -lt 15 ]; then
    printf '| %s | skipped (the %s s budget is spent) | 0 | |\n' "$name" "$BUDGET" >> "$TABLE"; return
  fi
  echo "gpu_check: $name" >&2
  timeout "$left" "$@" > "$W/$name.log" 2>&1 || status="FAILED ($?; see $name.log in logs.tar.gz)"
  local fig=""; [ "$status" = ok ] && fig=$(eval "$figures" 2>/dev/null | tr '\n' ' ')
  printf '| %s | %s | %s | %s |\n' "$name" "$status" $((SECONDS - t0)) "$fig" >> "$TABLE"
}
finish() {
  [ -f "$PLAN" ] && { printf '\nThe memory plan against one measured step (bench/plan_check.py):\n\n'; cat "$PLAN"; } >> "$TABLE"
  cp "$TABLE" "$W/"
  # logs and records, not the trained weights and optimiser states (megabytes that explain nothing)
  tar -czf "$OUT/logs.tar.gz" --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.bin' -C "$W" . && rm -rf "$W"
  cat "$TABLE"
}

# 1. the memory plan first: it is what the check is for, and the budget may not reach the end
PLAN=$W/plan_check.md
plan_rows() { echo "$(grep -c '| ok |$' "$PLAN") of $(grep -cE '[|] (ok|OFF) [|]$' "$PLAN") rows agree so far"; }
saved() { grep -h -m1 '^sharded state' "$W/$1.log"; }
STATE=${TMPDIR:-/tmp}/gpu_check_state.$$  # the timed save: tens of GB, so not under W (which is archived)
if [ "$DRY" = --cpu ]; then
  step plan_small "plan_rows; saved plan_small" -- $PY -m accelerate.commands.launch \
    --config_file configs/accelerate/fsdp_cpu.yaml bench/plan_check.py --cpu --table "$PLAN" --save-load "$STATE"
else
  step plan_3b "plan_rows" -- $PY -m accelerate.commands.launch "${FSDP[@]}" bench/plan_check.py \
    --model Qwen/Qwen2.5-3B-Instruct --tokens 16384 --table "$PLAN"
  step plan_7b_7layers "plan_rows; saved plan_7b_7layers" -- $PY -m accelerate.commands.launch "${FSDP[@]}" \
    bench/plan_check.py --model Qwen/Qwen2.5-7B-Instruct --layers 7 --tokens 16384 --table "$PLAN" --save-load "$STATE"
  rm -rf "$STATE"  # a step killed by its timeout leaves it
  # Qwen3's shape: q and k norms, no attention bias (the qwen3-4b and qwen3-8b presets)
  step plan_qwen3_4b_9layers "plan_rows" -- $PY -m accelerate.commands.launch "${FSDP[@]}" \
    bench/plan_check.py --model Qwen/Qwen3-4B-Instruct-2507 --layers 9 --tokens 16384 --table "$PLAN"
fi
rm -rf "$STATE"

# 2. bfcl-eval, which the stages import
install_wheels() {  # the wheels of .wheels/ whose package the machine lacks, into .gpu-site/
  rm -rf .gpu-site && mkdir -p .gpu-site
  local missing=()
  [ -d .wheels ] || echo "no .wheels/ (made by: bash bench/gpu_check.sh --prepare, where PyPI is reachable): the machine's own packages only"
  shopt -s nullglob
  mapfile -t missing < <($PY -c 'import importlib.metadata as m, os, sys
for whl in sys.argv[1:]:  # a wheel is named DISTRIBUTION-VERSION-...
    try:
        m.version(os.path.basename(whl).split("-")[0])
    except m.PackageNotFoundError:
        print(whl)' .wheels/*.whl)
  echo "installing: ${missing[*]:-nothing}"
  [ ${#missing[@]} -eq 0 ] || $PY -m pip install --disable-pip-version-check -q --no-deps --no-index --target .gpu-site "${missing[@]}"
  $PY -c "import torch, transformers, accelerate, peft, bfcl_eval, tree_sitter_java, openai; print(torch.__version__, torch.cuda.is_available())"
}
versions="$PY -c \"import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')\""
export -f install_wheels; export PY
step install "$versions" -- bash -c install_wheels

# 3. training on the prepared rollouts, as loop.sh runs it: LoRA (two rounds), then full fine-tuning
I=.gpu-inputs; M=$I/model
metrics() {  # the last metrics row of run $1, in brief, and the gradient dtypes its log $2 states
  echo "$PY -c \"import json,sys; m=[json.loads(l) for l in open(sys.argv[1])][-1]; print('global step', m['global_step'], 'tokens/s', round(m['tokens_per_s']), 'grad_norm %.3g' % m['grad_norm'], 'lr', m['lr'])\" $W/$1/metrics.jsonl; grep -h -m1 '^gradients accumulated' $W/$2.log"
}
TRAIN=(train_grpo.py --rollouts "$I/rollouts.jsonl" --diagnoses "$I/diagnoses.jsonl" --interface "$I/interface.json"
       --mini-batch-tasks 2 --save-optimizer "${CPU[@]}")
LAUNCH=($PY -m accelerate.commands.launch "${FSDP[@]}")
step train_lora_fsdp2 "$(metrics train_lora_b train_lora_a); grep -h -m1 '^adapter in' $W/train_lora_a.log" -- bash -c "\
  ${LAUNCH[*]} ${BF16_CPU[*]} ${TRAIN[*]} --model $M --lora --metrics $W/train_lora_a/metrics.jsonl \
    --out $W/train_lora_a/policy > $W/train_lora_a.log 2>&1 && \
  ${LAUNCH[*]} ${BF16_CPU[*]} ${TRAIN[*]} --model $W/train_lora_a/policy --optimizer-state $W/train_lora_a/policy/optimizer \
    --metrics $W/train_lora_b/metrics.jsonl --out $W/train_lora_b/policy"
step train_full_fsdp2 "$(metrics train_full train_full_fsdp2)" -- "${LAUNCH[@]}" "${TRAIN[@]}" --model "$M" --lr 1e-4 --ref-model "$M" \
  --metrics "$W/train_full/metrics.jsonl" --out "$W/train_full/policy"

# 4. FSDP2 with bf16 mixed precision (the GPU presets'): the log-probs stay float32
step logprob_dtype "grep -h -m1 '^log-probs' $W/logprob_dtype.log" \
  -- "${LAUNCH[@]}" tests/fsdp_bf16_probe.py "$M" "$I/rollouts.jsonl" "$I/diagnoses.jsonl" "$W/logprob_dtype.json"

# 5. throughput of the update
step update_throughput "tail -1 $W/update_throughput.log" -- $PY bench/update_throughput.py "${TPUT[@]}"
# the presets' objective (entropy in the log-prob pass, token-tis) against the paper's, step for step
step objective_cost "tail -1 $W/objective_cost.log" -- $PY bench/update_throughput.py --compare-objective \
  "${TPUT[@]}" --seqs 4

# 6. the stages on CUDA: play, a slice of the leaderboard's set (evaluate.py --split all), diagnose
step prepare "echo tasks ready" -- $PY data/prepare.py
$PY evolve.py --out "$W/interface.json" > /dev/null 2>&1
step rollout_hf "$PY -c \"import json,sys; s=json.load(open(sys.argv[1])); print(s['trajectories'], 'trajectories,', s['gen_tokens'], 'generated tokens')\" $W/rollout_summary.json" \
  -- $PY rollout.py --model "$M" --tasks data/tiny.jsonl "${TASK_ARGS[@]}" --n "$N" --engine hf --interface "$W/interface.json" \
     --max-new-tokens "$MAX_NEW" --max-steps-per-turn 3 --summary "$W/rollout_summary.json" --out "$W/rollouts.jsonl"
step eval_all "$PY -c \"import glob,json,sys; d=sys.argv[1]; s=json.load(open(d+'/scores.json')); n=sum(1 for f in glob.glob(d+'/result/*/multi_turn/*_result.json') for _ in open(f)); print(s['bfcl_eval']['tasks'], 'of the 800 tasks, average', s['average'], '%,', n, 'result entries')\" $W/eval_all" \
  -- timeout 180 $PY evaluate.py --policy "$M" --engine hf --split all --limit "$PER_CATEGORY" \
     --max-new-tokens "$MAX_NEW" --max-steps-per-turn 3 --out "$W/eval_all"
step diagnose "$PY -c \"import json,sys; r=[json.loads(l)['reward'] for l in open(sys.argv[1])]; print('mean reward', round(sum(r)/len(r),3))\" $W/diagnoses.jsonl" \
  -- $PY diagnose.py --tasks data/tiny.jsonl --rollouts "$W/rollouts.jsonl" --out "$W/diagnoses.jsonl"

finish
