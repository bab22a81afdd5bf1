#!/usr/bin/env bash
# Install nbdist and run notebooks/00-quickstart.ipynb headlessly: a small model trained with
# %%distributed on 2 local workers. The executed copy is written next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
bash scripts/install-torch.sh
"$PY" -m pip install -e ".[notebook]"
"$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=600 \
  --output 00-quickstart.nbconvert.ipynb notebooks/00-quickstart.ipynb
echo "executed notebook: notebooks/00-quickstart.nbconvert.ipynb"
