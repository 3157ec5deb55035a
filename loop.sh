#!/usr/bin/env bash
# The SEAL closed loop: rollout (under Ω_t) -> diagnose -> evolve (Ω_t+1) -> train, for N rounds.
#
#   bash loop.sh PRESET [--rounds N] [--mode seal|vanilla|no-env|no-reweight|no-closed-loop|seal-adaptive|seal-turn]
#                       [--name NAME] [--eval-every K] [--runs DIR] [--ood] [--set VAR=VALUE ...] [--plan]
#
# PRESET is tiny (CPU, minutes), qwen3b, qwen7b or toolace8b (the paper's, GPU nodes; see README),
# qwen3-4b or qwen3-8b. A GPU preset runs on the GPUs nvidia-smi -L lists, or --set GPUS=1|2|4|8.
# --set overrides one preset variable (e.g. --set N=4 --set TASKS_PER_ROUND=8); every variable, its
# default and each preset's values are in common/presets.py, as are the modes.
# --plan prints the GPU presets' per-GPU memory plan (common/train/memplan.py) and exits, installing and
# downloading nothing (python3 alone, on a fresh clone too); a run whose plan does not fit stops
# before setup and round 0, naming the variable to change.
# Every artifact lands in runs/NAME/ (docs/design.md §3). Rerunning the same command resumes
# from the first missing artifact: stages write atomically, so a file that exists is
# complete, and complete artifacts are never recomputed. KEEP (a preset variable) says
# which round policies stay on disk: evaluated (default), latest or all (docs/hardware.md §6).
# --set REPORT_TO=tensorboard,wandb (or all) logs every round's figures to those trackers
# (Accelerate's; TensorBoard's files under runs/NAME/tracking/; docs/tracking.md).
# --ood (or --set OOD="bfcl-memory tau2") also scores the base model and the final policy on
# the out-of-distribution benches after the last round (the paper's Table 2); τ²-bench needs
# a user simulator: --set USER_MODEL=DIR, or USER_BASE_URL=URL and USER_MODEL_NAME=NAME.
# --set ENV=tau2:DOMAIN trains on a τ²-bench domain instead of BFCL (docs/environments.md): its
# train split against that user simulator (on CPU without one, a scripted user), evaluated on its
# test split (--set TAU_K=k: k trials a task, pass^k); --set OOD="bfcl-heldin bfcl-memory" then
# scores BFCL held-in out of distribution.
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

# The settings, the memory plan and every refusal come first, from the standard library's Python
# (common/presets.py, common/train/memplan.py): on a fresh clone --plan needs no setup (whose GPU build is
# ~10 GB of downloads), only a python3, and a run that cannot go ahead stops before setup downloads anything.
PY=.venv/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "loop: needs a python3 (>= 3.8) on PATH, or PYTHON naming one" >&2; exit 2; }

# ---------------------------------------------------------------------------- presets and modes
# common/presets.py checks the preset, the mode and each --set, places a GPU preset on its GPUS,
# and prints every preset variable (MODEL=..., MAX_LEN=...), the mode's OMEGA, REWEIGHT, ADAPTIVE_RHO, TURN_CREDIT,
# LORA_RANK, and RECORD, what config.json records.
settings=$($PY -m common.presets "$PRESET" --mode "$MODE" "${SETS[@]+"${SETS[@]}"}") || exit 2
eval "$settings"
# The memory plan of a GPU preset, from the architecture numbers in configs/models/ (nothing loads).
if [ -n "$PLAN" ]; then
  if [ -z "$GPU_MEM_GIB" ]; then echo "loop: $PRESET runs on CPU: no GPU memory plan (set GPU_MEM_GIB for one)"; exit 0; fi
  exec $PY -m common.train.memplan "$PRESET" "${SETS[@]+"${SETS[@]}"}"
fi
# A thinking model's rollouts follow QwenFCHandler, which drops earlier turns' reasoning at a new user
# turn; the trajectory continues from that re-rendered prompt as a new segment, trained as its own
# sequence (docs/prompts.md). Another handler, or the chat template, would train it on prompts
# bfcl-eval never shows it.
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
  # on ENV=tau2:DOMAIN, the build whose warm start played that domain's tiny tasks (common/run/tiny.py)
  MODEL=$($PY -c "import sys; from common.run.tiny import build_cached; from common.jsonl import RecordError
try: print(build_cached(env=sys.argv[1]))
except RecordError as e: sys.exit(f'loop: ENV={sys.argv[1]}: {e}')" "$ENV") || exit 2
fi
# The call format follows the handler's prompts (common/envs/bfcl/prompts.py HANDLERS): a CALL_FORMAT that contradicts
# them would mis-decode every output. The stages get, and config.json records, the one used.
CALL_FORMAT=$($PY -c "import sys; from common.envs.bfcl.prompts import HandlerError, call_format
try: print(call_format(sys.argv[1], sys.argv[2]))
except HandlerError as e: sys.exit(f'loop: BFCL_HANDLER={sys.argv[1]} CALL_FORMAT={sys.argv[2]}: {e}')" \
  "$BFCL_HANDLER" "$CALL_FORMAT") || exit 2
RECORD=("${RECORD[@]/#call_format=*/call_format=$CALL_FORMAT}")
# The τ²-bench user simulator (training on ENV=tau2:DOMAIN, and the tau2 OOD bench), checked before any
# round runs; on CPU a τ² run without one plays against the scripted ScenarioUser (common/envs/tau2/tau2.py).
USER_ARGS=()
if [ -n "$USER_MODEL" ]; then
  USER_ARGS=(--user-model "$USER_MODEL" --user-tool-parser "$USER_TOOL_PARSER" --user-timeout "$USER_TIMEOUT")
  # on GPUs, beside the policy's server and trainer, in the share the memory plan counts (common/train/memplan.py)
  if [ -n "$GPU_MEM_GIB" ]; then
    USER_ARGS+=(--user-serve-args "$($PY -c 'import sys; from common.train.memplan import user_serve_args as a; print(a(sys.argv[1]))' "$MAX_LEN")")
  fi
elif [ -n "$USER_BASE_URL" ] && [ -n "$USER_MODEL_NAME" ]; then
  USER_ARGS=(--user-base-url "$USER_BASE_URL" --user-model-name "$USER_MODEL_NAME" --user-timeout "$USER_TIMEOUT")
fi
DOMAIN=""; [ "$ENV" = bfcl ] || DOMAIN=${ENV#tau2:}
ENV_USER=("${USER_ARGS[@]+"${USER_ARGS[@]}"}")
if [ -n "$DOMAIN" ] && [ ${#USER_ARGS[@]} -eq 0 ]; then ENV_USER=(--scripted-user); fi
# What evaluation scores, as the environment names it (common/envs/__init__.py eval_tasks: BFCL held-in, a τ²
# domain's test split), and the flags evaluate.py takes for it: τ²'s user simulator and trials (pass^k),
# BFCL's bfcl-eval entry.
EVAL_TASKS=$($PY -c "import sys; from common.envs import kind_of; print(kind_of(sys.argv[1]).eval_tasks(sys.argv[1]))" \
  "$ENV") || exit 2
EVAL_ARGS=(${BFCL_MODEL:+--bfcl-model "$BFCL_MODEL"})
if [ -n "$DOMAIN" ]; then EVAL_ARGS=(--trials "$TAU_K" "${ENV_USER[@]}"); fi
for b in $OOD; do
  case $b in
    bfcl-memory|bfcl-web|bfcl-heldin) ;;  # bfcl-heldin: a τ²-trained run's (common/presets.py checks)
    tau2)
      if [ ${#USER_ARGS[@]} -eq 0 ]; then
        echo "loop: OOD tau2 needs a user simulator: --set USER_MODEL=DIR (served with vllm serve)," \
          "or --set USER_BASE_URL=URL --set USER_MODEL_NAME=NAME" >&2; exit 2
      fi ;;
    *) echo "loop: OOD=$OOD: benches are bfcl-memory, bfcl-web, tau2 and (for ENV=tau2:DOMAIN) bfcl-heldin" >&2; exit 2 ;;
  esac
done
NAME=${NAME:-$PRESET-$MODE${DOMAIN:+-$DOMAIN}}

# Rollouts and every evaluation (held-in and OOD) play with the same engine, handler, step limit
# and call format (COMMON_ARGS); only their lengths differ (MAX_LEN/MAX_NEW, EVAL_LEN/EVAL_NEW).
# SCORE_ARGS is what decides the scores; its text is recorded in the base model's config.json.
COMMON_ARGS=(--engine "$ENGINE" --handler "$BFCL_HANDLER" --max-steps-per-turn "$MAX_STEPS" --call-format "$CALL_FORMAT")
SCORE_ARGS=("${COMMON_ARGS[@]}" ${EVAL_LEN:+--max-model-len "$EVAL_LEN"} ${EVAL_NEW:+--max-new-tokens "$EVAL_NEW"})
PLAY_ARGS=("${SCORE_ARGS[@]}")
# The base model's scores are shared by every run of the preset under $RUNS, so they must come
# from one model and one set of evaluation settings: a run with others stops here. Where they
# live is common/run/runinfo.py base_dir's rule (evaluate.py --compare and common/run/report.py find them by it).
BASE=$RUNS/base-$PRESET${DOMAIN:+-tau2-$DOMAIN}  # common/run/runinfo.py base_dir's rule
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
  # A hub id at its pinned REVISION (recorded above as id and commit, not as a path under
  # HF_HOME): fetched once into the HF cache; every stage then works on the local folder.
  MODEL=$($PY -m common.run.fetch "$MODEL" "$REVISION") || exit 1
fi

# run STAGE ROUND OUTPUT CMD...: skip when OUTPUT exists (or was deleted by KEEP after a
# later round used it), else run with a log and a timing line.
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
# One vLLM server (common/engine/serve.py: vLLM's own, data parallel over the node's GPUs) for the whole
# run, or the servers SERVER names (URL[,URL...], started by the user). It is started at the
# first stage that plays, on the policy that stage plays (a rerun: the last complete one), loads
# each new policy in place, sleeps on GPUs while the trainer holds them, and is stopped with its
# whole process group when the run ends, fails or is interrupted.
SERVER_STATE=$RUN/server.json
SERVER_LOG=$RUN/logs/server.log
GPU=$($PY -c "from common.engine.serve import cpu_build; print('' if cpu_build() else 1)")
# the server's context holds rollouts (MAX_LEN) and evaluation (EVAL_LEN, else the model's own):
# memplan's server_len, the rule the memory plan counts the server's KV cache by
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

evaluate() {  # evaluate POLICY ROUND DIR: EVAL_TASKS (BFCL held-in, bfcl-eval's decoding; τ²: the domain's test split), Ω removed
  run eval "$2" "$3/scores.json" playing "$1" $PY evaluate.py --policy "$1" --tasks "$EVAL_TASKS" \
    $(limit_args "$EVAL_LIMIT") "${PLAY_ARGS[@]}" "${EVAL_ARGS[@]+"${EVAL_ARGS[@]}"}" --out "$3"
}

ood() {  # ood POLICY TAG DIR: every bench of $OOD (its own decoding: docs/ood.md), Ω removed, into DIR/<bench>/
  local b bench
  for b in $OOD; do
    bench=(-m ood.memory --suite "$b")
    if [ "$b" = tau2 ]; then bench=(-m ood.tau --trials "$TAU_K" "${USER_ARGS[@]}"); fi
    if [ "$b" = bfcl-heldin ]; then bench=(evaluate.py --split heldin); fi  # a τ²-trained run's BFCL score
    run "ood-$2-$b" $((ROUNDS - 1)) "$3/$b/scores.json" playing "$1" $PY "${bench[@]}" --policy "$1" \
      $(limit_args "$OOD_LIMIT") "${PLAY_ARGS[@]}" --out "$3/$b"
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
  # one process, accelerate launch over NPROC, or in a SLURM allocation of several nodes one
  # accelerate launch per node through srun (common/train/launch.py)
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
    --temperature "$TEMP" --seed $((SEED * 1000 + t)) --prompts "$PROMPTS" ${DOMAIN:+"${ENV_USER[@]}"} \
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
