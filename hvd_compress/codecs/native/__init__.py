"""The C++ block kernel (blocks.cpp), built ahead of time by scripts/setup.sh.

    python -m hvd_compress.codecs.native       # build into ./build (a minute), then check it

Never compiled at first import: several ranks importing at once must not race a compiler.
`module()` loads the built library if it was built from this source for this torch, and
returns its ops (`encode`, `decode_accumulate`, `encode_values`, `encode_message`,
`decode_messages`); otherwise None, and codecs/blocks.py runs its
pure-torch path, the reference the kernel is tested against bit for bit.
HVD_COMPRESS_NATIVE=0 switches the kernel off; HVD_COMPRESS_F16C=0 keeps its portable loops on a
CPU with AVX2 and F16C (kernels_x86.h otherwise).
"""
import functools
import glob
import hashlib
import os

__all__ = ["module", "built", "build", "SOURCES", "BUILD_DIR", "FORMATS"]

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, f) for f in ("blocks.cpp", "kernels.h", "kernels_x86.h")]  # hashed into TAG
BUILD_DIR = os.path.join(HERE, "build")
NAME = "hvdc_blocks"
FORMATS = ("e4m3fn", "float16")
# -O3 and -fno-trapping-math let GCC vectorise the branch-free loops (blocks.cpp says why each
# flag is safe for exactness); AVX2 clones are chosen at run time, so no -march=native: the
# library must run on whichever x86-64 runs the tests. -fopenmp: at::parallel_for's threads.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _tag():
    import torch
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for path in SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"{digest.hexdigest()[:16]} torch {torch.__version__}"


def built(build_dir=BUILD_DIR):
    """The path of the library in `build_dir` if it was built from these sources for this
    torch, else None (HVD_COMPRESS_NATIVE plays no part: scripts/setup.sh asks this)."""
    try:
        with open(os.path.join(build_dir, "TAG")) as f:
            if f.read().strip() != _tag():
                return None
    except OSError:
        return None
    found = glob.glob(os.path.join(build_dir, NAME + "*.so"))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def module():
    """torch.ops.hvdc (encode, decode_accumulate, encode_values), or None when not built,
    stale, or switched off by HVD_COMPRESS_NATIVE=0."""
    if os.environ.get("HVD_COMPRESS_NATIVE", "1") == "0":
        return None
    path = built()
    if path is None:
        return None
    import torch
    torch.ops.load_library(path)
    return torch.ops.hvdc


def build(verbose=False, build_dir=BUILD_DIR):
    """Compile blocks.cpp into `build_dir` with torch's cpp_extension (which also loads it into
    this process); write TAG last. Returns the library's path."""
    from torch.utils.cpp_extension import load
    os.makedirs(build_dir, exist_ok=True)
    tag_file = os.path.join(build_dir, "TAG")
    if os.path.exists(tag_file):
        os.remove(tag_file)
    load(name=NAME, sources=SOURCES[:1], build_directory=build_dir, extra_cflags=list(CFLAGS),
         extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=verbose)  # load() edits them
    with open(tag_file, "w") as f:
        f.write(_tag() + "\n")
    module.cache_clear()
    return built(build_dir)
