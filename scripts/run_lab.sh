#!/usr/bin/env bash
# The course lab end to end (labs/kit/job.py): set up; the table of trainings over loopback;
# as root, the same parallel rows over an emulated 100 Mbit/s network with a calibration of
# that link and predictions; the report and its plots. 39-60 minutes on 2 cores, by CPU
# (docs/lab.md, "How long it takes, and how well it predicts").
#
#   bash scripts/run_lab.sh                                  # Fashion-MNIST, 2 epochs, gloo
#   DATASET=mnist DATA_DIR=/path/to/mnist bash scripts/run_lab.sh
#   EPOCHS=5 CONTROLLER=mpi OUT=runs/matrix-mpi REPORT=runs/matrix-mpi/report.md \
#       bash scripts/run_lab.sh --extras --no-network
#
# Environment: DATASET (fashion-mnist | mnist), DATA_DIR, SPLIT_TEST, EPOCHS (default: the
# trainer's, 2), CONTROLLER (gloo | mpi), OUT (default runs/matrix), REPORT (default runs/report.md;
# the PNGs go next to it). Extra arguments go to labs/kit/job.py (--no-network,
# --network-rate, --network-steps) or to the run matrix (--only, --extras, --methods,
# --timeout ...). An interrupted lab resumes where it stopped: run the same command again.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

bash scripts/setup.sh

PY=${HVD_COMPRESS_VENV:-$ROOT/.venv}/bin/python
DATASET=${DATASET:-fashion-mnist}
CONTROLLER=${CONTROLLER:-gloo}
OUT=${OUT:-runs/matrix}
REPORT=${REPORT:-runs/report.md}

# Fashion-MNIST is the one full data set available offline: Debian packages it.
if [ "$DATASET" = fashion-mnist ] && [ -z "${DATA_DIR:-}" ] \
    && [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  echo "[lab] installing Debian's dataset-fashion-mnist"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

job_args=(--dataset "$DATASET" --controller "$CONTROLLER" --out "$OUT" --report "$REPORT")
[ -n "${EPOCHS:-}" ] && job_args+=(--epochs "$EPOCHS")
[ -n "${DATA_DIR:-}" ] && job_args+=(--data-dir "$DATA_DIR")
[ -n "${SPLIT_TEST:-}" ] && job_args+=(--split-test "$SPLIT_TEST")

echo "[lab] the table, the network table, the report: ${job_args[*]} $*"
"$PY" -m labs.kit.job "${job_args[@]}" "$@"
echo "[lab] done: $REPORT"
