"""The kernel's build on first use where it cannot build (codecs/native): with no compiler, or a
compiler that fails, the torch path runs and the one warning says why; a failed build is
written down once and not retried by every process that starts, until the build command asks.
(Several processes starting together with an empty cache compile once: test_packaging.py, on
the installed wheel.)"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import hvd_compress as hc
from hvd_compress.codecs import E4M3, blocks, native

FIRST_USE = ("from hvd_compress.codecs import native\n"
             "assert native.module() is None\n"
             "print(native.why_missing())\n")


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """An empty kernel cache for this process's loader (module() forgets what it loaded)."""
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HVD_COMPRESS_NATIVE", raising=False)
    native.module.cache_clear()
    yield tmp_path / "cache"
    native.module.cache_clear()


@pytest.mark.unit
def test_without_a_compiler_the_torch_path_runs_and_the_warning_says_why(empty_cache,
                                                                         monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setattr(blocks, "_missing_warned", [])
    assert native.module() is None and blocks.codec_path(E4M3) == "torch"
    message = torch.zeros(hc.Compression.bit8.message_bytes(1000), dtype=torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hc.Compression.bit8.encode_message(torch.randn(1000), message)
    texts = [str(w.message) for w in caught if "native" in str(w.message)]
    assert len(texts) == 1 and "no C++ compiler found ('no-such-c++'" in texts[0], texts
    assert "python -m hvd_compress.codecs.native" in texts[0]
    assert not empty_cache.exists()                       # nothing was tried


@pytest.mark.build
def test_a_failed_build_is_recorded_once_and_retried_only_when_asked(tmp_path):
    calls = tmp_path / "calls"
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\n"                   # answers torch's questions, fails to compile
                        f'case "$*" in *blocks.cpp*) echo "$@" >> {calls}; '
                        "echo 'broken-c++: no' >&2; exit 1;; esac\nexec c++ \"$@\"\n")
    compiler.chmod(0o755)
    env = dict(os.environ, HVD_COMPRESS_CACHE=str(tmp_path / "cache"), CXX=str(compiler),
               CCACHE_DISABLE="1")
    env.pop("HVD_COMPRESS_NATIVE", None)

    def python(*args):
        return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    first = python("-c", FIRST_USE)
    assert first.returncode == 0 and "its build failed (log: " in first.stdout, first.stderr[-3000:]
    failed = first.stdout.split("(log: ")[1].split(")")[0]
    with open(failed) as f:
        assert "broken-c++: no" in f.read()
    tried = calls.read_text()
    assert "blocks.cpp" in tried                          # it did try to compile

    again = python("-c", FIRST_USE)                       # the next process: the torch path at once
    assert again.returncode == 0 and "its build failed" in again.stdout, again.stderr[-3000:]
    assert calls.read_text() == tried

    asked = python("-m", "hvd_compress.codecs.native")    # the build command tries again
    assert asked.returncode == 1 and "[native] the build failed" in asked.stderr, asked.stderr[-3000:]
    assert calls.read_text().count("blocks.cpp") > tried.count("blocks.cpp")


@pytest.mark.unit
def test_a_build_prunes_kernels_of_older_sources_for_this_torch_only(empty_cache):
    """After an upgrade of the sources, the old kernel of this same torch and Python can never be
    loaded again: prune_stale removes it. Another venv's kernel (other torch), a folder mid-build
    (no TAG) and a folder whose lock another process holds stay."""
    import fcntl
    ours = native._tag().split(" ", 1)[1]
    root = empty_cache / "kernels"

    def folder(name, tag):
        path = root / f"{native.NAME}-{name}"
        path.mkdir(parents=True)
        if tag is not None:
            (path / "TAG").write_text(tag + "\n")
        return path

    current = folder("current", native._tag())
    stale = folder("stale", "0123456789abcdef " + ours)
    other_torch = folder("othertorch", "0123456789abcdef torch 0.0.1 cpython-311 x86_64")
    building = folder("building", None)
    held = folder("held", "fedcba9876543210 " + ours)
    fd = os.open(held / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:                            # flock: two opens conflict even within one process
        removed = native.prune_stale(str(current))
    finally:
        os.close(fd)
    assert removed == [str(stale)] and not stale.exists()
    assert current.exists() and other_torch.exists() and building.exists() and held.exists()
