#!/usr/bin/env bash
# Set up this kit on a Debian 12 machine (given): Debian packages, a virtualenv at .venv with
# torch, and Horovod 0.28.1 built from its PyPI sdist with this kit's patch series
# (patches/series: the given C++17 and Gloo fixes, and your course patch).
#
#   bash setup.sh                         # everything (the Horovod build: 5-15 min once)
#   bash setup.sh --no-horovod            # steps 1 (serial) and 2 only: torch, the data, check.py
#   bash setup.sh --rebuild-horovod       # after changing patches/course-bit8-bit16.patch
#   HOROVOD_WHEEL=path/to/horovod-0.28.1-*.whl bash setup.sh   # a wheel built elsewhere
#
# Then: source .venv/bin/activate; python check.py; python train.py --epochs 1
set -euo pipefail

KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${KIT_VENV:-$KIT/.venv}
PY=$VENV/bin/python
HOROVOD_VERSION=0.28.1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
HOROVOD=1 REBUILD=0
for arg in "$@"; do
  case "$arg" in
    --no-horovod) HOROVOD=0 ;;
    --rebuild-horovod) REBUILD=1 ;;
    *) echo "usage: bash setup.sh [--no-horovod] [--rebuild-horovod]" >&2; exit 2 ;;
  esac
done
log() { printf '[kit setup] %s\n' "$*"; }

# 1. Debian packages: Python's venv, a C++ toolchain, cmake and patch for the Horovod build,
#    and Fashion-MNIST (MNIST, if you have it: python train.py --dataset mnist --data-dir DIR).
packages=(python3-venv patch dataset-fashion-mnist)
[ "$HOROVOD" = 1 ] && packages+=(g++ make cmake)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtualenv: torch (CPU) and NumPy, and Horovod's own runtime requirements.
[ -x "$PY" ] || { log "creating $VENV"; python3 -m venv "$VENV"; }
if ! "$PY" -c "import torch, numpy" 2>/dev/null; then
  log "installing torch $TORCH_VERSION and NumPy"
  "$PY" -m pip install -q "torch==$TORCH_VERSION" "numpy>=1.24,<3" cloudpickle psutil pyyaml packaging wheel
fi

# 3. Horovod 0.28.1 with this kit's patches (Gloo and PyTorch, no MPI: horovodrun --gloo).
if [ "$HOROVOD" = 1 ]; then
  if [ "$REBUILD" = 0 ] && "$PY" -c "import horovod.torch" 2>/dev/null; then
    log "Horovod is installed (bash setup.sh --rebuild-horovod after changing a patch)"
  elif [ -n "${HOROVOD_WHEEL:-}" ]; then
    log "installing $HOROVOD_WHEEL"
    "$PY" -m pip install -q --force-reinstall --no-deps "$HOROVOD_WHEEL"
  else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    log "downloading the Horovod $HOROVOD_VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    grep -v '^\s*#' "$KIT/patches/series" | sed '/^\s*$/d' | while read -r name; do
      grep -q '^+++ ' "$KIT/patches/$name" || { log "patches/$name holds no diff yet: skipped"; continue; }
      log "applying patches/$name"
      patch -d "$src" -p1 --batch --forward < "$KIT/patches/$name" >/dev/null
    done
    log "building Horovod (5-15 min on 2 cores)"
    (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
       HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
       "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" .)
    "$PY" -m pip install -q --force-reinstall --no-deps "$work"/wheel/horovod-*.whl
  fi
fi

# 4. Check that the data can be read.
(cd "$KIT" && "$PY" -c "import data; data.load(train_samples=1, test_samples=1)") ||
  { log "the data cannot be read: see the message above"; exit 1; }
log "ready: source $VENV/bin/activate; python check.py; python train.py --epochs 1"
