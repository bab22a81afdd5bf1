#!/usr/bin/env bash
# Install nbdist and run notebooks/00-quickstart.ipynb headlessly: a small model trained with
# %%distributed on 2 local workers, checked by the notebook's own last cells. The executed copy
# goes outside the repository (the checkout stays as it was):
#   NBDIST_QUICKSTART_DIR   where to write it (default: $TMPDIR/nbdist-quickstart, else /tmp/...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${NBDIST_QUICKSTART_DIR:-${TMPDIR:-/tmp}/nbdist-quickstart}
bash scripts/install-torch.sh
"$PY" -m pip install -e ".[notebook]"
mkdir -p "$OUT"
t0=$(date +%s)
"$PY" -m jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=600 \
  --output-dir "$OUT" --output 00-quickstart.ipynb notebooks/00-quickstart.ipynb
# What the run showed, read from the executed notebook's outputs.
"$PY" - "$OUT/00-quickstart.ipynb" "$(($(date +%s) - t0))" <<'EOF'
import json
import re
import sys

path, seconds = sys.argv[1], sys.argv[2]
text = "\n".join("".join(o.get("text") or o.get("data", {}).get("text/plain", ""))
                 for c in json.load(open(path))["cells"] for o in c.get("outputs", []))
ranks = re.findall(r"\[\d+\] rank (\d+)/(\d+) .*device=(\S+) .*backend=(\S+)", text)
accuracy = re.search(r"accuracy of the pulled model on held-out data: ([\d.]+)", text)
workers = f"{ranks[0][1]} workers ({ranks[0][3]} on {ranks[0][2]})" if ranks else "? workers"
print(f"\nquickstart: trained a classifier on {workers}; held-out accuracy of the model "
      f"pulled back into the notebook {accuracy.group(1) if accuracy else '?'}; "
      f"the notebook ran in {seconds} s")
print(f"executed notebook: {path}  (open it with: jupyter lab {path})")
EOF
