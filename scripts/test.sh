#!/usr/bin/env bash
# Install the test dependencies and run the whole suite (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
bash scripts/install-torch.sh
"$PY" -m pip install -e ".[test,slurm,ssh]"
# The browser tests drive Debian's chromium, the multi-host tests use network namespaces, the
# launcher tests a real Slurm (slurm-wlm, munge) and a real sshd (openssh-server), all started
# from temporary directories on loopback: install what they need where this user may (as
# root, with apt).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  [ -x /usr/bin/chromium ] || need+=(chromium chromium-driver)
  command -v ip >/dev/null || need+=(iproute2)
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
  command -v sshd >/dev/null || need+=(openssh-server)
  command -v ssh >/dev/null || need+=(openssh-client)
  if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${need[@]}" \
      || { apt-get update && apt-get install -y --no-install-recommends "${need[@]}"; }
  fi
fi
"$PY" -m ruff check .
"$PY" -m pytest "$@"
