#!/usr/bin/env bash
# Set up hvd-compress on a fresh Debian 12 machine: Open MPI, a virtualenv at .venv with
# torch, Horovod 0.28.1 built from its PyPI sdist with PyTorch + MPI + Gloo (patched, see
# patches/series), and this package in editable mode.
#
# Idempotent: the Horovod wheel is built once (~4-15 min on 2 cores) and cached outside the
# clone, keyed by Horovod, torch, Python and the patches; a second run takes seconds.
#
#   bash scripts/setup.sh --wheel-only PATCH_DIR   # only build (or find) the Horovod wheel of
#                                                  # PATCH_DIR's series, print its folder (your
#                                                  # own patches: their build runs as you; the
#                                                  # classroom's grader builds a student's in
#                                                  # the kit's sandbox, never with this)
#
# Its caches (HVD_COMPRESS_CACHE, default ~/.cache/hvd-compress: the sdist, the wheels, ccache,
# the codec kernel) are each made whole under a name of their own, then renamed into place: a
# reader without the lock (the classroom's grader reads the sdist) never takes a half-made one.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOROVOD_VERSION=0.28.1
CACHE=${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd-compress}
VENV=${HVD_COMPRESS_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
PATCHES=$ROOT/patches
WHEEL_ONLY=0
if [ "${1:-}" = --wheel-only ]; then
  [ -n "${2:-}" ] && [ -f "$2/series" ] || { echo "usage: setup.sh --wheel-only PATCH_DIR (with a series file)" >&2; exit 2; }
  WHEEL_ONLY=1; PATCHES=$(cd "$2" && pwd)
fi

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# One setup at a time per cache: a second one (another checkout, the lab and the tests started
# together) waits here instead of building Horovod twice into the same folder.
mkdir -p "$CACHE"
take_lock() {
  exec 9>"$CACHE/setup.lock"
  flock -w 3600 9 || die "another scripts/setup.sh has held $CACHE/setup.lock for an hour"
}
# (--wheel-only takes it only to build: finding a cached wheel needs no lock)
[ "$WHEEL_ONLY" = 1 ] || take_lock

if [ "$WHEEL_ONLY" = 0 ]; then
# 1. System packages: Open MPI for Horovod's MPI controller, a C++ toolchain and cmake for the
#    Horovod build, ccache so a patch change rebuilds in a minute, iproute2 for the emulated
#    network, and Debian's Fashion-MNIST: the only full data set this offline machine can have.
#    bubblewrap: the classroom grader runs each student's kit in a sandbox of its own.
apt_packages=(openmpi-bin libopenmpi-dev g++ make cmake ccache iproute2 python3-venv patch
              util-linux dataset-fashion-mnist bubblewrap)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtualenv and the Python requirements (reinstalled only when requirements.txt changes).
[ -x "$PY" ] || { log "creating $VENV"; python3 -m venv "$VENV"; }
req_hash=$(sha256sum "$ROOT/requirements.txt" | cut -c1-16)
if [ "$(cat "$VENV/.requirements-hash" 2>/dev/null)" != "$req_hash" ]; then
  log "installing requirements.txt into $VENV"
  "$PY" -m pip install -q -r "$ROOT/requirements.txt" 2>&1 | grep -v '^WARNING: Location' || true
  "$PY" -c "import torch, numpy" || die "requirements did not install"
  echo "$req_hash" > "$VENV/.requirements-hash"
fi
elif [ ! -x "$PY" ]; then
  die "no $VENV: run scripts/setup.sh first"
fi

# 3. Horovod: build the patched sdist into a cached wheel once, install it into the venv.
# (read from the installed metadata: importing torch costs seconds, and this runs every time)
torch_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
py_tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
patch_list=$(grep -v '^\s*#' "$PATCHES/series" | sed '/^\s*$/d')
patch_hash=$(cd "$PATCHES" && cat series $patch_list | sha256sum | cut -c1-12)
key="horovod-$HOROVOD_VERSION-torch$torch_version-$py_tag-$patch_hash"
wheel_dir="$CACHE/wheels/$key"

build_horovod_wheel() {
  local work sdist src
  mkdir -p "$CACHE/sdist"
  sdist="$CACHE/sdist/horovod-$HOROVOD_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    log "downloading the Horovod $HOROVOD_VERSION sdist"
    local fetched
    fetched=$(mktemp -d "$CACHE/sdist/.download.XXXXXX")
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$fetched"
    mv "$fetched/horovod-$HOROVOD_VERSION.tar.gz" "$sdist" && rm -rf "$fetched"
  fi
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  tar xzf "$sdist" -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  for p in $patch_list; do
    # a course patch not written yet (a student's kit: text, no diff) changes nothing
    grep -q '^+++ ' "$PATCHES/$p" || { log "skipping $PATCHES/$p: no diff in it yet"; continue; }
    log "applying $PATCHES/$p"
    patch -p1 -d "$src" --forward --quiet < "$PATCHES/$p" || die "$PATCHES/$p does not apply"
  done
  log "building Horovod $HOROVOD_VERSION against torch $torch_version (takes minutes; log: $CACHE/build.log)"
  mkdir -p "$work/wheel"
  ( cd "$src" && \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS= \
    CCACHE_DIR="$CACHE/ccache" MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --no-build-isolation --no-deps -w "$work/wheel" . ) > "$CACHE/build.log" 2>&1 \
    || { tail -40 "$CACHE/build.log" >&2; die "the Horovod build failed (full log: $CACHE/build.log)"; }
  mkdir -p "$CACHE/wheels"
  local made
  made=$(mktemp -d "$CACHE/wheels/.$key.XXXXXX")
  mv "$work/wheel"/* "$made"/ && chmod 755 "$made"
  mv -T "$made" "$wheel_dir" 2>/dev/null || rm -rf "$made"    # another's, whole, is already there
}

if [ "$WHEEL_ONLY" = 1 ]; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    take_lock
    ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 || build_horovod_wheel
  fi
  echo "$wheel_dir"
  exit 0
fi
if [ "$(cat "$VENV/.horovod-key" 2>/dev/null)" != "$key" ]; then
  ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 || build_horovod_wheel
  log "installing the cached Horovod wheel ($key)"
  "$PY" -m pip install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl 2>&1 | grep -v '^WARNING: Location' || true
  echo "$key" > "$VENV/.horovod-key"
fi

# 4. This package, editable, from this checkout (again when pyproject.toml or the checkout's
#    place changes). The package is the plugin alone, so a .pth line puts the checkout's root
#    on the venv's path too: `labs` imports in every process the venv runs (the lab, the
#    tests, the scripts, ranks that horovodrun starts elsewhere). Checked from / so that the
#    current directory on sys.path cannot pass for an install.
pkg_key="$(realpath "$ROOT") $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
installed_at=$(cd / && "$PY" -c 'import hvd_compress, labs, os; print(os.path.dirname(os.path.dirname(os.path.realpath(hvd_compress.__file__))))' 2>/dev/null || true)
if [ "$installed_at" != "$(realpath "$ROOT")" ] || [ "$(cat "$VENV/.hvd-compress-key" 2>/dev/null)" != "$pkg_key" ]; then
  log "installing hvd_compress (editable) from $ROOT"
  "$PY" -m pip install -q --no-deps -e "$ROOT" 2>&1 | grep -v '^WARNING: Location' || true
  realpath "$ROOT" > "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/hvd_compress_checkout.pth"
  (cd / && "$PY" -c 'import hvd_compress, labs') || die "hvd_compress or labs does not import after pip install -e"
  echo "$pkg_key" > "$VENV/.hvd-compress-key"
fi

# 5. The codec's C++ kernel (hvd_compress/codecs/native): built here, once, into the per-user
#    cache ($CACHE/kernels, where every process of the plugin looks for it; again only when its
#    sources, flags or torch change), so that no rank of the lab or the tests pays the first
#    use's build (which takes a lock: one process compiles, the others wait). ~10-15 s.
# 6. Check: Horovod imports with PyTorch and carries MPI and Gloo, and the kernel is built.
#    One process for all of it (each import of torch costs seconds; this runs before every
#    test run). Exit 3: only the kernel is missing.
ready() {
  (cd / && "$PY" - <<'PY'
import sys
import horovod
import horovod.torch as hvd
import torch
from hvd_compress.codecs import native
missing = [name for name, built in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if not built]
if missing:
    sys.exit(f"[setup] error: Horovod lacks {' and '.join(missing)}")
if native.built() is None:
    sys.exit(3)
print(f"torch {torch.__version__} | horovod {horovod.__version__}")
PY
  )
}
status=0; versions=$(ready) || status=$?
if [ "$status" = 3 ]; then
  log "building the native codec kernel"
  "$PY" -m hvd_compress.codecs.native || die "the native codec kernel did not build"
  status=0; versions=$(ready) || status=$?
fi
[ "$status" = 0 ] || die "Horovod or the native kernel is not usable in $VENV (see above)"
log "ready: $versions | venv $VENV"
