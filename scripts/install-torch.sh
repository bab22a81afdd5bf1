#!/usr/bin/env bash
# Put a CPU build of torch in place, but only where no torch is installed: a GPU user's CUDA
# build is never replaced, and nbdist itself only asks for a range (torch>=2.13).
#   NBDIST_TORCH_VERSION   version to install (default 2.13.0)
#   NBDIST_TORCH_INDEX     an index that serves CPU builds, e.g.
#                          https://download.pytorch.org/whl/cpu (default: pip's own settings)
set -euo pipefail
PY=${PYTHON:-python}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed; keeping it"
  exit 0
fi
args=("torch==${NBDIST_TORCH_VERSION:-2.13.0}")
if [ -n "${NBDIST_TORCH_INDEX:-}" ]; then
  args+=(--index-url "$NBDIST_TORCH_INDEX")
fi
"$PY" -m pip install "${args[@]}"
