"""The C++ block kernel (blocks.cpp), built ahead of time by scripts/setup.sh.

    python -m hvd_compress.codecs.native       # build into ./build (a minute), then check it

Never compiled at first import: several ranks importing at once must not race a compiler.
`module()` loads the built library if it was built from this source for this torch, and
returns its ops (`encode`, `decode_accumulate`); otherwise None, and codecs/blocks.py runs its
pure-torch path, the reference the kernel is tested against bit for bit.
HVD_COMPRESS_NATIVE=0 switches the kernel off.
"""
import functools
import glob
import hashlib
import os

__all__ = ["module", "build", "SOURCE", "BUILD_DIR", "FORMATS"]

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "blocks.cpp")
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
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:16]
    return f"{digest} torch {torch.__version__}"


@functools.lru_cache(maxsize=None)
def module():
    """torch.ops.hvdc (encode, decode_accumulate), or None when not built / stale / off."""
    if os.environ.get("HVD_COMPRESS_NATIVE", "1") == "0":
        return None
    try:
        with open(os.path.join(BUILD_DIR, "TAG")) as f:
            if f.read().strip() != _tag():
                return None
    except OSError:
        return None
    found = glob.glob(os.path.join(BUILD_DIR, NAME + "*.so"))
    if not found:
        return None
    import torch
    torch.ops.load_library(found[0])
    return torch.ops.hvdc


def build(verbose=False):
    """Compile blocks.cpp into BUILD_DIR with torch's cpp_extension; write TAG last."""
    from torch.utils.cpp_extension import load
    os.makedirs(BUILD_DIR, exist_ok=True)
    tag_file = os.path.join(BUILD_DIR, "TAG")
    if os.path.exists(tag_file):
        os.remove(tag_file)
    load(name=NAME, sources=[SOURCE], build_directory=BUILD_DIR, extra_cflags=list(CFLAGS),
         extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=verbose)  # load() edits them
    with open(tag_file, "w") as f:
        f.write(_tag() + "\n")
    module.cache_clear()
    return module()
