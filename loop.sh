#!/usr/bin/env bash
# The SEAL closed loop: rollout (under Ω_t) -> diagnose -> evolve (Ω_t+1) -> train, for N rounds.
#
#   bash loop.sh PRESET [--rounds N] [--mode seal|vanilla|no-env|no-reweight|no-closed-loop|seal-adaptive|seal-turn]
#                       [--name NAME] [--eval-every K] [--runs DIR] [--ood] [--set VAR=VALUE ...] [--plan]
#
# PRESET: tiny (CPU, minutes), qwen3b, qwen7b, toolace8b (the paper's), qwen3-4b, qwen3-8b (GPU nodes; README).
# --set overrides one preset variable; every variable, its default and the modes are in common/presets.py.
# --set ENV=tau2:DOMAIN (or any kind of common/envs/__init__.py) trains on another environment
# (docs/environments.md). --ood (OOD="bfcl-memory tau2") also scores the base model and the final policy on
# the out-of-distribution benches after the last round; τ²'s needs USER_MODEL or USER_BASE_URL and USER_MODEL_NAME.
# --plan prints a GPU preset's memory plan and exits (python3 alone, nothing installed). Every artifact lands in
# runs/NAME/ (docs/design.md §3); rerunning the same command resumes from the first missing artifact.
set -euo pipefail
cd "$(dirname "$0")"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }  # the header comment, however many lines it has
[ $# -ge 1 ] || usage
PRESET=$1; shift
MODE=seal; NAME=""; SETS=(); RUNS=runs; PLAN=""
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) SETS+=(--set "ROUNDS=$2"); shift 2 ;;
    --mode) MODE=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --eval-every) SETS+=(--set "EVAL_EVERY=$2"); shift 2 ;;
    --set) SETS+=(--set "$2"); shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --ood) SETS+=(--set "OOD=bfcl-memory tau2"); shift ;;
    --plan) PLAN=1; shift ;;
    -h|--help) usage ;;
    *) echo "loop: unknown argument $1" >&2; usage ;;
  esac
done

# The settings, the memory plan and every refusal come first, from the standard library's Python: a run that
# cannot go ahead stops before setup downloads anything.
PY=.venv/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "loop: needs a python3 (>= 3.8) on PATH, or PYTHON naming one" >&2; exit 2; }

# ---------------------------------------------------------------------------- presets and modes
# every preset variable, the mode's, RECORD, and what ENV's kind decides (common/presets.py env_shell)
settings=$($PY -m common.presets "$PRESET" --mode "$MODE" "${SETS[@]+"${SETS[@]}"}") || exit 2
eval "$settings"
# The memory plan of a GPU preset, from the architecture numbers in configs/models/ (nothing loads).
if [ -n "$PLAN" ]; then
  if [ -z "$GPU_MEM_GIB" ]; then echo "loop: $PRESET runs on CPU: no GPU memory plan (set GPU_MEM_GIB for one)"; exit 0; fi
  exec $PY -m common.train.memplan "$PRESET" "${SETS[@]+"${SETS[@]}"}"
fi
if [ -n "$THINKING" ] && { [ "$BFCL_HANDLER" != QwenFCHandler ] || [ "$PROMPTS" != bfcl ]; }; then
  echo "loop: THINKING=1 ($PRESET's model writes <think>...</think> before each answer) needs" \
    "BFCL_HANDLER=QwenFCHandler and PROMPTS=bfcl, which drop earlier turns' reasoning as bfcl-eval does" \
    "(got BFCL_HANDLER=$BFCL_HANDLER, PROMPTS=$PROMPTS)" >&2
  exit 2
fi
if [ "$MODEL" != offline-tiny ] && [ ! -d "$MODEL" ] && ! [[ $REVISION =~ ^[0-9a-f]{40}$ ]]; then
  echo "loop: REVISION='$REVISION': $MODEL is a hub id and its commit must be pinned (--set REVISION=<40-hex commit>)," \
    "so that a resume downloads the same weights" >&2
  exit 2
fi
if [ -n "$GPU_MEM_GIB" ]; then
  $PY -m common.train.memplan --brief "$PRESET" "${SETS[@]+"${SETS[@]}"}" \
    || { echo "loop: stopped by the memory plan (bash loop.sh $PRESET --plan shows its terms)" >&2; exit 2; }
  # a GPU preset on a machine without (enough) GPUs would only fail later
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  need=$((NPROC > DP * TP ? NPROC : DP * TP))
  if [ "$gpus" -lt "$need" ]; then
    echo "loop: $PRESET runs on $need GPUs and this machine has $gpus (nvidia-smi -L); the preset that runs" \
      "on CPU is tiny (bash loop.sh tiny), or lower GPUS with --set" >&2
    exit 2
  fi
  $PY -m common.train.memplan --host "$PRESET" "${SETS[@]+"${SETS[@]}"}" || exit 2
fi
bash setup.sh
PY=.venv/bin/python
# a tracker that is not installed stops here with its pip line, before any model is built or fetched
$PY -m common.run.tracking --check "$REPORT_TO" || exit 2
if [ "$MODEL" = offline-tiny ]; then
  # the build whose warm start played ENV's tiny tasks (common/run/tiny.py)
  MODEL=$($PY -c "import sys; from common.run.tiny import build_cached; from common.jsonl import RecordError
try: print(build_cached(env=sys.argv[1]))
except RecordError as e: sys.exit(f'loop: ENV={sys.argv[1]}: {e}')" "$ENV") || exit 2
fi
# The call format follows the handler's prompts (common/engine/episode.py CALL_FORMATS); config.json records it.
CALL_FORMAT=$($PY -c "import sys; from common.engine.episode import HandlerError, call_format
try: print(call_format(sys.argv[1], sys.argv[2]))
except HandlerError as e: sys.exit(f'loop: BFCL_HANDLER={sys.argv[1]} CALL_FORMAT={sys.argv[2]}: {e}')" \
  "$BFCL_HANDLER" "$CALL_FORMAT") || exit 2
RECORD=("${RECORD[@]/#call_format=*/call_format=$CALL_FORMAT}")
NAME=${NAME:-$PRESET-$MODE$RUN_SUFFIX}

# Rollouts and every evaluation play with the same engine, handler, step limit and call format (COMMON_ARGS);
# only their lengths differ. SCORE_ARGS decides the scores; the base model's config.json records it.
COMMON_ARGS=(--engine "$ENGINE" --handler "$BFCL_HANDLER" --max-steps-per-turn "$MAX_STEPS" --call-format "$CALL_FORMAT")
SCORE_ARGS=("${COMMON_ARGS[@]}" ${EVAL_LEN:+--max-model-len "$EVAL_LEN"} ${EVAL_NEW:+--max-new-tokens "$EVAL_NEW"})
# The base model's scores are shared by every run of the preset and ENV under $RUNS, so they must come from one
# model and one set of evaluation settings (common/run/runinfo.py base_dir finds them).
BASE=$RUNS/base-$PRESET$BASE_SUFFIX
if ! $PY -m common.run.runinfo "$BASE/config.json" model="$MODEL" revision="$REVISION" eval_limit="$EVAL_LIMIT" play="${SCORE_ARGS[*]}" tau_k="$TAU_K"; then
  echo "loop: $BASE holds the base model's scores for the settings above; use another --runs, or remove it" >&2
  exit 2
fi
RUN=$RUNS/$NAME
mkdir -p "$RUN/logs"
# the run's settings, its model as the stages get it (the tiny model: its built folder)
$PY -m common.run.runinfo "$RUN/config.json" name="$NAME" "${RECORD[@]}" model="$MODEL" \
  || { echo "loop: $RUN was run with the settings above; use another --name, or remove it" >&2; exit 2; }
if [ ! -d "$MODEL" ]; then
  # a hub id at its pinned REVISION, fetched once into the HF cache; the stages work on the local folder
  MODEL=$($PY -m common.run.fetch "$MODEL" "$REVISION") || exit 1
fi

# run STAGE ROUND OUTPUT CMD...: skip when OUTPUT exists (or KEEP deleted it), else run with a log and a timing
run() {
  local stage=$1 round=$2 output=$3; shift 3
  if [ -e "$output" ] || [ -e "$output.deleted" ]; then echo "loop: round $round $stage: done ($output)"; return; fi
  local log="$RUN/logs/round_$(printf %03d "$round")_$stage.log"
  echo "loop: round $round $stage -> $output (log: $log)"
  AT="round $round, $stage"
  local t0; t0=$(date +%s%N)
  if ! "$@" 2>&1 | tee "$log"; then
    echo "loop: stage '$stage' failed in round $round; see $log" >&2
    exit 1
  fi
  local ms=$((($(date +%s%N) - t0) / 1000000))
  echo "{\"round\": $round, \"stage\": \"$stage\", \"seconds\": $((ms / 1000)).$(printf %03d $((ms % 1000)))}" \
    >> "$RUN/timing.jsonl"
  AT="round $round, after $stage"
}

track() {  # log what is new in the run's artifacts to the trackers; a failure is retried next round
  if [ "$REPORT_TO" = none ] || [ -z "$REPORT_TO" ]; then return; fi
  $PY -m common.run.tracking "$RUN" --report-to "$REPORT_TO" \
    || echo "loop: logging to $REPORT_TO failed (the next call retries what was not logged)" >&2
}

WORKERS=$(nproc); WORKERS=$((WORKERS < 16 ? WORKERS : 16))  # diagnosis processes (a τ² episode's replay is ~1 s)
limit_args() { [ -n "$1" ] && echo "--limit $1"; true; }

# ---------------------------------------------------------------------------- the engine
# One vLLM server (common/engine/serve.py) for the whole run, or the servers SERVER names: started at the first
# stage that plays, stopped with the run (docs/hardware.md §4).
SERVER_STATE=$RUN/server.json
SERVER_LOG=$RUN/logs/server.log
GPU=$($PY -c "from common.engine.serve import cpu_build; print('' if cpu_build() else 1)")
# the server's context holds rollouts (MAX_LEN) and evaluation (EVAL_LEN, else the model's own): memplan's rule
SERVE_LEN=$($PY -c "import sys; from common.engine.models import model_context as c; from common.train.memplan import server_len
print(server_len(sys.argv[1], sys.argv[2], 0 if sys.argv[2] else c(sys.argv[3])))" "$MAX_LEN" "$EVAL_LEN" "$MODEL")
SERVE_ARGS=(--max-model-len "$SERVE_LEN" --seed "$SEED" --tensor-parallel-size "$TP" --data-parallel-size "$DP"
  ${LORA:+--lora-rank "$LORA_RANK"} ${GPU:+--sleep-mode})
stop_server() { [ -z "$SERVER" ] && [ -f "$SERVER_STATE" ] && $PY -m common.engine.serve stop --state "$SERVER_STATE"; true; }
trap stop_server EXIT
AT="round 0, setup"  # where the loop is, for an interruption's message (run() updates it)
trap 'echo "loop: interrupted in $AT; rerun the same command to resume" >&2; exit 130' INT
trap 'exit 143' TERM

playing() {  # playing POLICY CMD...: CMD on the run's server(s), which serve POLICY first
  local policy=$1 urls=$SERVER; shift
  if [ "$ENGINE" != vllm ]; then "$@"; return; fi
  if [ -z "$urls" ]; then
    urls=$($PY -m common.engine.serve start --model "$policy" --state "$SERVER_STATE" --log "$SERVER_LOG" \
      "${SERVE_ARGS[@]}") || return 1
    "$@" --server "$urls" --server-log "$SERVER_LOG"
  else
    $PY -m common.engine.serve reload --server "$urls" --model "$policy" || return 1
    "$@" --server "$urls"
  fi
}

evaluate() {  # evaluate POLICY ROUND DIR: EVAL_TASKS, as ENV's kind names them, Ω removed
  run eval "$2" "$3/scores.json" playing "$1" $PY evaluate.py --policy "$1" --tasks "$EVAL_TASKS" \
    $(limit_args "$EVAL_LIMIT") "${SCORE_ARGS[@]}" "${ENV_EVAL[@]+"${ENV_EVAL[@]}"}" --out "$3"
}

ood() {  # ood POLICY TAG DIR: every bench of $OOD (OOD_i: its --tasks and flags), Ω removed, into DIR/<bench>/
  local i ref bench
  for ((i = 0; i < $(wc -w <<< "$OOD"); i++)); do
    ref="OOD_$i[@]"; bench=("${!ref}")
    run "ood-$2-${bench[0]}" $((ROUNDS - 1)) "$3/${bench[0]}/scores.json" playing "$1" $PY evaluate.py --policy "$1" \
      --tasks "${bench[@]}" $(limit_args "$OOD_LIMIT") "${SCORE_ARGS[@]}" --out "$3/${bench[0]}"
  done
}

train() {  # train ROUND_DIR POLICY: KL to the round-0 model, one optimiser carried from round to round
  # (its state folder also holds the float32 master weights when the policy is saved in bf16)
  local words launch state=()
  if [ "$2" != "$MODEL" ]; then state=(--optimizer-state "$2/optimizer"); fi
  if [ -n "$GPU" ] && [ -z "$SERVER" ] && [ -f "$SERVER_STATE" ]; then
    # the trainer takes the server's GPUs: never beside an awake server (errexit is off in here)
    $PY -m common.engine.serve sleep --state "$SERVER_STATE" || {
      echo "loop: the vLLM server of $SERVER_STATE did not go to sleep (log $SERVER_LOG); not training beside it" >&2
      return 1; }
  fi
  # one process, accelerate launch over NPROC, or one per SLURM node through srun (common/train/launch.py)
  words=$($PY -m common.train.launch "$PY" "$NPROC" "$ACCEL_CONFIG") || return 1
  mapfile -t launch <<< "$words"
  "${launch[@]}" train_grpo.py --model "$2" --rollouts "$1/rollouts.jsonl" --diagnoses "$1/diagnoses.jsonl" \
    --interface "$1/interface.json" $REWEIGHT $ADAPTIVE_RHO $TURN_CREDIT --lr "$LR" --kl-coef "$KL" --mini-batch-tasks "$MINI_BATCH" \
    --max-tokens-per-micro-batch "$MICRO_TOKENS" $LORA ${LORA:+--lora-r "$LORA_RANK"} $EXTRA_TRAIN --seed "$SEED" \
    --ref-model "$MODEL" --save-optimizer "${state[@]+"${state[@]}"}" --out "$1/policy" \
    --rollout-is "$ROLLOUT_IS" --rollout-is-cap "$ROLLOUT_IS_CAP" ${CLIP_HIGH:+--clip-high "$CLIP_HIGH"} \
    --adv-scale "$ADV_SCALE" --ratio-level "$RATIO_LEVEL" --cut "$CUT" --max-model-len "$MAX_LEN" \
    ${EVAL_LEN:+--eval-len "$EVAL_LEN"}
}

prune() {  # prune ROUND: what KEEP lets go once round ROUND's policy exists (never the base model)
  if [ "$KEEP" = all ]; then return; fi
  local s dir
  for ((s = 0; s < $1; s++)); do
    dir=$RUN/round_$(printf %03d "$s")/policy
    rm -rf "$dir/optimizer" "$(dirname "$dir")"/.tmp-policy-*  # and what a killed save left there
    if [ -d "$dir" ] && { [ "$KEEP" = latest ] || [ ! -e "$RUN/eval/round_$(printf %03d "$s")/scores.json" ]; }; then
      # the marker first: it tells a rerun that this round is done, even if rm is interrupted
      echo "deleted by loop.sh (KEEP=$KEEP) once round $1's policy existed" > "$dir.deleted"
      rm -rf "$dir"
    fi
  done
}

# The base model is scored once per preset and shared by every run (and mode) of it (BASE above).
evaluate "$MODEL" 0 "$BASE/eval"
policy=$MODEL
for ((t = 0; t < ROUNDS; t++)); do
  R=$RUN/round_$(printf %03d "$t")
  NEXT=$RUN/round_$(printf %03d $((t + 1)))
  mkdir -p "$R" "$NEXT"
  run interface "$t" "$R/interface.json" $PY evolve.py --mode "$MODE" --out "$R/interface.json"
  run rollout "$t" "$R/rollouts.jsonl" playing "$policy" $PY rollout.py --model "$policy" --tasks "$TASKS" \
    $(limit_args "$TRAIN_LIMIT") --batch "$TASKS_PER_ROUND" --round "$t" --n "$N" --interface "$R/interface.json" \
    "${COMMON_ARGS[@]}" --max-model-len "$MAX_LEN" --max-new-tokens "$MAX_NEW" \
    --temperature "$TEMP" --seed $((SEED * 1000 + t)) --prompts "$PROMPTS" "${ENV_PLAY[@]+"${ENV_PLAY[@]}"}" \
    --summary "$R/rollout_summary.json" --out "$R/rollouts.jsonl"
  run diagnose "$t" "$R/diagnoses.jsonl" $PY diagnose.py --tasks "$TASKS" --workers "$WORKERS" \
    --rollouts "$R/rollouts.jsonl" --out "$R/diagnoses.jsonl"
  run evolve "$t" "$NEXT/interface.json" $PY evolve.py --mode "$MODE" --diagnoses "$R/diagnoses.jsonl" \
    --previous "$R/interface.json" --round $((t + 1)) --out "$NEXT/interface.json"
  run train "$t" "$R/policy" train "$R" "$policy"
  policy=$R/policy
  if [ $(((t + 1) % EVAL_EVERY)) -eq 0 ] || [ $((t + 1)) -eq "$ROUNDS" ]; then
    evaluate "$policy" "$t" "$RUN/eval/round_$(printf %03d "$t")"
  fi
  prune "$t"
  $PY -m common.run.report "$RUN" > /dev/null
  $PY -m common.run.view "$RUN" > /dev/null || echo "loop: the viewer was not rebuilt (python -m common.run.view $RUN says why)" >&2
  track
done
if [ -n "$OOD" ]; then
  ood "$MODEL" base "$BASE/ood"
  ood "$policy" final "$RUN/ood/round_$(printf %03d $((ROUNDS - 1)))"
  track
fi
$PY -m common.run.view "$RUN" > /dev/null || echo "loop: the viewer was not rebuilt (python -m common.run.view $RUN says why)" >&2
$PY -m common.run.report "$RUN"
