#!/usr/bin/env bash
# Set up (scripts/setup.sh: idempotent, seconds when done before) and run the whole test suite:
# codecs, compressors, multi-process exchange under real horovodrun (Gloo and MPI, 2-4 ranks),
# the in-tree Horovod patch, the cost model, the network emulation and the lab end to end.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
