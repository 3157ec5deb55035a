#!/usr/bin/env bash
# The GPU check: one short script for a bare single-GPU machine (H100/H200 class, with torch,
# transformers, accelerate and peft preinstalled, no vLLM, no internet).
#
#   bash bench/gpu_check.sh --fetch-wheels   # here, first: wheels the GPU machine lacks -> .wheels/
#   bash bench/gpu_check.sh OUTDIR           # there (.wheels/ carried along): the check, <= 8 min
#   bash bench/gpu_check.sh OUTDIR --cpu     # dry run on CPU, small sizes, same steps
#
# Steps, each timed and allowed to fail on its own (the table says which did), all within
# GPU_CHECK_BUDGET seconds (470; a step gets what is left, the rest are skipped):
#   1. install bfcl-eval and what the machine lacks of what it imports from .wheels/ into .gpu-site/
#   2. bench/plan_check.py: the memory plan (common/memplan.py) term by term against one measured
#      update step through one-process FSDP2, 16384 tokens, random weights at the presets' shapes
#      (configs/models/): Qwen2.5-3B whole, Qwen2.5-7B with 7 of its 28 layers (dry run: a small
#      Qwen2, FSDP2 on two CPU processes); after the 7B step, one sharded save of its state (float32
#      master weights and AdamW's moments, common/checkpoint.py, 33 GB) and its load, timed
#   3. prepare the task files and build the CPU preset's tiny model (common/tiny.py)
#   4. rollout.py --engine hf on CUDA: the tiny preset's tasks, 4 samples each, through Ω_0
#   4b. evaluate.py --split all --engine hf on CUDA: the first 2 tasks of each category (dry run: 1) of
#      the 800 the BFCL leaderboard scores, with bfcl-eval's result files
#   5. diagnose.py, then train_grpo.py on CUDA (bf16 autocast, --zero-variance keep): once plain,
#      once through `accelerate launch` with a one-process FSDP config (dry run: two DDP CPU
#      processes); the table shows the dtypes gradients were accumulated and reduced in (float32)
#   5b. tests/fsdp_bf16_probe.py: FSDP2 with bf16 mixed precision on the GPU (dry run: two CPU
#      processes): the log-probs the loss uses are float32, equal to a float32 log-softmax of the bf16 logits
#   6. bench/update_throughput.py: Qwen2.5-3B-sized random model, gradient checkpointing,
#      8 sequences of 8k tokens: tokens/s, peak GPU memory, MFU (989 TFLOP/s dense bf16)
#   7. bench/plan_check.py at Qwen3-4B's shape, 9 of its 36 layers (not in the dry run)
# Writes OUTDIR/gpu_check.md (the table, then the plan check's rows), OUTDIR/*.log and the stage outputs.
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

if [ "${1:-}" = --fetch-wheels ]; then
  pins=$($PY -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
         "${WHEELS[@]}") || { echo "gpu_check: run setup.sh first: the pins are the versions it installs" >&2; exit 1; }
  rm -rf .wheels && mkdir -p .wheels
  # shellcheck disable=SC2086
  $PY -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: -d .wheels \
    --python-version "$GPU_PYTHON" --implementation cp --abi "cp${GPU_PYTHON/./}" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $pins || exit 1
  ls -l .wheels
  exit
fi
[ $# -ge 1 ] || { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
OUT=$(realpath -m "$1"); DRY=${2:-}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = --cpu ]; then
  export CUDA_VISIBLE_DEVICES=""
  N=2; TPUT=(--cpu --config small --seqs 2 --seq-len 512); FSDP=(--config_file configs/accelerate/ddp_cpu2.yaml)
  CPU=(--cpu); TASK_ARGS=(--limit 1); MAX_NEW=32; PER_CATEGORY=1
else
  N=4; TPUT=(); FSDP=(--config_file configs/accelerate/fsdp_1gpu.yaml); CPU=(); TASK_ARGS=(); MAX_NEW=96; PER_CATEGORY=2
fi
TABLE=$OUT/gpu_check.md
printf '| step | status | seconds | figures |\n|---|---|---|---|\n' > "$TABLE"

# step NAME FIGURES_CMD -- CMD...: run CMD (log in OUTDIR/NAME.log), then add a row with FIGURES_CMD's output.
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
  timeout "$left" "$@" > "$OUT/$name.log" 2>&1 || status="FAILED ($?; see $name.log)"
  local fig=""; [ "$status" = ok ] && fig=$(eval "$figures" 2>/dev/null | tr '\n' ' ')
  printf '| %s | %s | %s | %s |\n' "$name" "$status" $((SECONDS - t0)) "$fig" >> "$TABLE"
}

install_wheels() {  # the wheels of .wheels/ whose package the machine lacks, into .gpu-site/
  rm -rf .gpu-site && mkdir -p .gpu-site
  local missing=()
  [ -d .wheels ] || echo "no .wheels/ (made by: bash bench/gpu_check.sh --fetch-wheels, where PyPI is reachable): the machine's own packages only"
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

# the memory plan first: it is what the check is for, and the budget may not reach the end
PLAN=$OUT/plan_check.md; rm -f "$PLAN"
plan_rows() { echo "$(grep -c '| ok |$' "$PLAN") of $(grep -cE '[|] (ok|OFF) [|]$' "$PLAN") rows agree so far"; }
saved() { grep -h -m1 '^sharded state' "$OUT/$1.log"; }
STATE=${TMPDIR:-/tmp}/gpu_check_state.$$  # the timed save: tens of GB, so not under OUTDIR (which travels back)
if [ "$DRY" = --cpu ]; then
  step plan_small "plan_rows; saved plan_small" -- $PY -m accelerate.commands.launch \
    --config_file configs/accelerate/fsdp_cpu.yaml bench/plan_check.py --cpu --table "$PLAN" --save-load "$STATE"
else
  step plan_3b "plan_rows" -- $PY -m accelerate.commands.launch "${FSDP[@]}" bench/plan_check.py \
    --model Qwen/Qwen2.5-3B-Instruct --tokens 16384 --table "$PLAN"
  step plan_7b_7layers "plan_rows; saved plan_7b_7layers" -- $PY -m accelerate.commands.launch "${FSDP[@]}" \
    bench/plan_check.py --model Qwen/Qwen2.5-7B-Instruct --layers 7 --tokens 16384 --table "$PLAN" --save-load "$STATE"
fi
rm -rf "$STATE"  # a step killed by its timeout leaves it

step prepare "echo tasks ready" -- $PY data/prepare.py
[ -f data/tiny.jsonl ] && TASKS=data/tiny.jsonl || TASKS=data/train.jsonl
step build_model "cat $OUT/model_path; $PY -c \"import json,sys; i=json.load(open(sys.argv[1])); print('build s', i['timings']['total_s'], 'training s', i['timings']['train_s'])\" \$(cat $OUT/model_path)/build_info.json" \
  -- bash -c "$PY -c 'from common.tiny import build_cached; print(build_cached())' > $OUT/model_path"
M=$(cat "$OUT/model_path" 2>/dev/null)

$PY evolve.py --out "$OUT/interface.json" > /dev/null 2>&1
step rollout_hf "$PY -c \"import json,sys; s=json.load(open(sys.argv[1])); print(s['trajectories'], 'trajectories,', s['gen_tokens'], 'generated tokens')\" $OUT/rollout_summary.json" \
  -- $PY rollout.py --model "$M" --tasks "$TASKS" "${TASK_ARGS[@]}" --n "$N" --engine hf --interface "$OUT/interface.json" \
     --max-new-tokens "$MAX_NEW" --max-steps-per-turn 3 --summary "$OUT/rollout_summary.json" --out "$OUT/rollouts.jsonl"

# A slice of the leaderboard's set (evaluate.py --split all), at the rollout step's lengths; capped so
# that a slow play leaves the training steps their time.
step eval_all "$PY -c \"import glob,json,sys; d=sys.argv[1]; s=json.load(open(d+'/scores.json')); n=sum(1 for f in glob.glob(d+'/result/*/multi_turn/*_result.json') for _ in open(f)); print(s['bfcl_eval']['tasks'], 'of the 800 tasks, average', s['average'], '%,', n, 'result entries')\" $OUT/eval_all" \
  -- timeout 180 $PY evaluate.py --policy "$M" --engine hf --split all --limit "$PER_CATEGORY" \
     --max-new-tokens "$MAX_NEW" --max-steps-per-turn 3 --out "$OUT/eval_all"
step diagnose "$PY -c \"import json,sys; r=[json.loads(l)['reward'] for l in open(sys.argv[1])]; print('mean reward', round(sum(r)/len(r),3))\" $OUT/diagnoses.jsonl" \
  -- $PY diagnose.py --tasks "$TASKS" --rollouts "$OUT/rollouts.jsonl" --out "$OUT/diagnoses.jsonl"

metrics() {  # the last metrics row of a train run, in brief, and the gradient dtypes its log states
  echo "$PY -c \"import json,sys; m=[json.loads(l) for l in open(sys.argv[1])][-1]; print('steps', m['step'], 'tokens/s', m.get('tokens_per_s'), 'grad_norm', m.get('grad_norm'))\" $OUT/$1/metrics.jsonl; grep -h -m1 '^gradients accumulated' $OUT/$1.log"
}
TRAIN=(train_grpo.py --model "$M" --rollouts "$OUT/rollouts.jsonl" --diagnoses "$OUT/diagnoses.jsonl"
       --interface "$OUT/interface.json" --lr 1e-4 --mini-batch-tasks 2 --ref-model "$M" --save-optimizer "${CPU[@]}"
       --zero-variance keep)  # the tiny model often solves nothing: the steps still run, every one
step train_plain "$(metrics train_plain)" \
  -- $PY "${TRAIN[@]}" --metrics "$OUT/train_plain/metrics.jsonl" --out "$OUT/train_plain/policy"
step train_accelerate "$(metrics train_accelerate)" \
  -- $PY -m accelerate.commands.launch "${FSDP[@]}" "${TRAIN[@]}" --metrics "$OUT/train_accelerate/metrics.jsonl" \
     --out "$OUT/train_accelerate/policy"

# FSDP2 with bf16 mixed precision (the GPU presets'): the log-probs stay float32 (dry run: two CPU processes)
[ "$DRY" = --cpu ] && BF16=(--config_file configs/accelerate/fsdp_cpu.yaml) || BF16=("${FSDP[@]}")
step logprob_dtype "grep -h -m1 '^log-probs' $OUT/logprob_dtype.log" \
  -- $PY -m accelerate.commands.launch "${BF16[@]}" tests/fsdp_bf16_probe.py "$M" "$OUT/rollouts.jsonl" \
     "$OUT/diagnoses.jsonl" "$OUT/logprob_dtype.json"

step update_throughput "tail -1 $OUT/update_throughput.log" -- $PY bench/update_throughput.py "${TPUT[@]}"

# Qwen3's shape (q and k norms, no attention bias; the qwen3-4b and qwen3-8b presets), last: what is left of the budget
[ "$DRY" = --cpu ] || step plan_qwen3_4b_9layers "plan_rows" -- $PY -m accelerate.commands.launch "${FSDP[@]}" \
  bench/plan_check.py --model Qwen/Qwen3-4B-Instruct-2507 --layers 9 --tokens 16384 --table "$PLAN"

[ -f "$PLAN" ] && { printf '\nThe memory plan against one measured step (bench/plan_check.py):\n\n'; cat "$PLAN"; } >> "$TABLE"

cat "$TABLE"
