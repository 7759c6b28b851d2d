#!/usr/bin/env bash
# The course lab end to end: set up, run the table of trainings, fill the report, draw the plots.
#
#   bash scripts/run_lab.sh                                  # Fashion-MNIST, 3 epochs, gloo
#   DATASET=mnist DATA_DIR=/path/to/mnist bash scripts/run_lab.sh
#   EPOCHS=5 CONTROLLER=mpi OUT=runs/matrix-mpi REPORT=runs/matrix-mpi/report.md \
#       bash scripts/run_lab.sh --extras
#
# Environment: DATASET (fashion-mnist | mnist), DATA_DIR, SPLIT_TEST, EPOCHS (default 3),
# CONTROLLER (gloo | mpi), OUT (default runs/matrix), REPORT (default report.md; the PNGs go
# next to it). Extra arguments go to scripts/run_matrix.py (--only, --extras, --timeout ...).
# An interrupted lab resumes where it stopped: run the same command again.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

bash scripts/setup.sh

PY=${HVD_COMPRESS_VENV:-$ROOT/.venv}/bin/python
DATASET=${DATASET:-fashion-mnist}
EPOCHS=${EPOCHS:-3}
CONTROLLER=${CONTROLLER:-gloo}
OUT=${OUT:-runs/matrix}
REPORT=${REPORT:-report.md}

# Fashion-MNIST is the one full data set available offline: Debian packages it.
if [ "$DATASET" = fashion-mnist ] && [ -z "${DATA_DIR:-}" ] \
    && [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  echo "[lab] installing Debian's dataset-fashion-mnist"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

matrix_args=(--dataset "$DATASET" --epochs "$EPOCHS" --controller "$CONTROLLER" --out "$OUT")
[ -n "${DATA_DIR:-}" ] && matrix_args+=(--data-dir "$DATA_DIR")
[ -n "${SPLIT_TEST:-}" ] && matrix_args+=(--split-test "$SPLIT_TEST")

echo "[lab] run matrix: ${matrix_args[*]} $*"
"$PY" scripts/run_matrix.py "${matrix_args[@]}" "$@"

echo "[lab] report and plots"
"$PY" scripts/fill_report.py --summary "$OUT/summary.csv" --out "$REPORT"
"$PY" scripts/plot_runs.py --summary "$OUT/summary.csv" --out-dir "$(dirname "$REPORT")"
echo "[lab] done: $REPORT"
