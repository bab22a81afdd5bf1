#!/usr/bin/env bash
# Run every nbdist benchmark from the repository root; arguments go to `python -m benchmarks`
# (e.g. --quick for a smoke run, --engine dask, --log FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m benchmarks "$@"
