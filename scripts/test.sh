#!/usr/bin/env bash
# Install the test dependencies and run the whole suite (arguments go to pytest).
#   NBDIST_DEPS   which releases of the dependencies to test against:
#                 installed (default): keep what is installed where it satisfies pyproject.toml
#                 newest: upgrade every dependency to its newest allowed release (CI does)
#                 lowest: every dependency at its lower bound in pyproject.toml
#                 torch is never upgraded or replaced: the build in place (CPU or CUDA) stays.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
bash scripts/install-torch.sh
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# torch as pip knows the installed one (its metadata: 2.6.0 for PyPI's CUDA build, not +cu124)
"$PY" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
  >"$constraints"
case "${NBDIST_DEPS:-installed}" in
  installed) "$PY" -m pip install -c "$constraints" -e ".[test,slurm,ssh]" ;;
  newest) "$PY" -m pip install --upgrade --upgrade-strategy eager -c "$constraints" -e ".[test,slurm,ssh]" ;;
  lowest)
    "$PY" scripts/lowest-constraints.py >>"$constraints"
    "$PY" -m pip install -c "$constraints" -e ".[test,slurm,ssh]" ;;
  *) echo "NBDIST_DEPS must be installed, newest or lowest" >&2; exit 2 ;;
esac
echo "testing against:" $("$PY" -m pip list --format=freeze \
  | grep -iE '^(torch|ipython|ipykernel|ipyparallel|distributed|ipywidgets|jupyterlab)==')
# The browser tests drive Debian's chromium, the multi-host tests use network namespaces, the
# launcher tests a real Slurm (slurm-wlm, munge) and a real sshd (openssh-server), all started
# from temporary directories on loopback, the attach tests Open MPI's mpirun (openmpi-bin):
# install what they need where this user may (as root, with apt).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  [ -x /usr/bin/chromium ] || need+=(chromium chromium-driver)
  command -v ip >/dev/null || need+=(iproute2)
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
  command -v sshd >/dev/null || need+=(openssh-server)
  command -v ssh >/dev/null || need+=(openssh-client)
  command -v mpirun >/dev/null || need+=(openmpi-bin)
  if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${need[@]}" \
      || { apt-get update && apt-get install -y --no-install-recommends "${need[@]}"; }
  fi
fi
"$PY" -m ruff check .
"$PY" -m pytest "$@"
