"""The registry reaches everything: a scheme registered in one file of its own (through
HVD_COMPRESS_SCHEMES, as a user's plugin is) appears in the cost model's CLI (--methods rows,
--bits, the packet exchanges), the lab's flags, table and report, and the step benchmark's
rows, with no other edit; bf16, shipped, appears in each as well."""
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.interpreter

ROOT = Path(__file__).resolve().parents[1]

# A throwaway 4-bit packet scheme: the registry entry alone (no torch), a class to load.
THROWAWAY = textwrap.dedent('''
    from hvd_compress.registry import Route, Scheme, register


    class ThrowawayCompressor:
        name = "throwaway"


    register(Scheme(
        name="throwaway", bits=4, routes=(Route.ALLGATHER, Route.ALLTOALL),
        summary="a scheme that lives only in this test", compressor=ThrowawayCompressor,
        flag="--throwaway-allreduce", code_bytes=lambda numel: -(-numel // 2)))
''')


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "throwaway_scheme.py").write_text(THROWAWAY)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]),
                HVD_COMPRESS_SCHEMES="throwaway_scheme")


def run(env, *args):
    done = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_the_cost_model_cli_lists_every_registered_scheme(plugin_env):
    out = run(plugin_env, "-m", "hvd_compress.costmodel", "--methods", "basic", "--nodes", "2",
              "--bandwidth", "100Mbit/s", "--latency", "50us", "--format", "csv")
    rows = pd.read_csv(io.StringIO(out)).set_index("method")
    assert {"bf16", "throwaway"} <= set(rows.index)
    assert rows.loc["throwaway", "route"] == "allgather"
    # 4 bits a value and a scale per 256: a little over an eighth of float32's bytes
    assert 0.125 < rows.loc["throwaway", "bytes_vs_fp32"] < 0.14
    chosen = run(plugin_env, "-m", "hvd_compress.costmodel", "--methods", "basic", "--nodes",
                 "2", "--bandwidth", "100Mbit/s", "--latency", "50us", "--format", "csv",
                 "--schemes", "throwaway:alltoall", "bf16:allgather")
    picked = pd.read_csv(io.StringIO(chosen))
    assert list(zip(picked.method, picked.route)) == [("throwaway", "alltoall"),
                                                      ("bf16", "allgather")]
    out = run(plugin_env, "-m", "hvd_compress.costmodel", "--nodes", "4", "--size", "32MiB",
              "--bandwidth", "10Gbit/s", "--latency", "1ms", "--bits", "4", "--format", "csv")
    rows = pd.read_csv(io.StringIO(out))
    assert set(rows.scheme) == {"allgather", "alltoall"} and (rows.bits == 4).all()


def test_without_the_plugin_its_width_and_name_are_refused():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HVD_COMPRESS_SCHEMES", None)
    bad = subprocess.run([sys.executable, "-m", "hvd_compress.costmodel", "--nodes", "4",
                          "--size", "32MiB", "--bandwidth", "10Gbit/s", "--latency", "1ms",
                          "--bits", "4"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 4" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "hvd_compress.costmodel", "--methods", "basic",
                          "--nodes", "2", "--bandwidth", "100Mbit/s", "--latency", "50us",
                          "--schemes", "throwaway"], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "HVD_COMPRESS_SCHEMES" in bad.stderr


def test_the_lab_and_the_step_benchmark_list_every_registered_scheme(plugin_env):
    script = textwrap.dedent("""
        import importlib.util, sys
        from labs.kit import flags, report, table
        from labs import mnist
        assert flags.compression_flags()["throwaway"] == "throwaway_allreduce"
        sys.argv = ["mnist.py", "--throwaway-allreduce"]
        args = mnist.parse_args()
        assert args.compression == "throwaway" and table.config_name(args, 2) == "np2-throwaway"
        assert table.METHOD_FLAGS["throwaway"] == ["--throwaway-allreduce"]
        assert table.METHOD_FLAGS["bf16"] == ["--bf16-allreduce"]
        runs = {run.name: run.flags for run in table.course_runs(methods=True)}
        assert runs["np2-throwaway"] == ["--throwaway-allreduce"] and "np4-bf16" in runs
        import pandas as pd
        empty = pd.DataFrame({"compression": ["none"], "ranks": [1], "run": ["serial"]})
        note = report.methods_section(empty)
        assert "bf16" in note and "throwaway" in note, note
        from labs.bench import step as bench
        rows = bench.known_rows()
        assert {"ours:throwaway", "ours:throwaway:alltoall", "ours:bf16:allgather"} <= set(rows)
        assert bench.parse_args(["--rows", "ours:throwaway:alltoall"]).rows == ["ours:throwaway:alltoall"]
        compression, route = bench.row_compression("ours:throwaway:alltoall")
        assert compression.__name__ == "ThrowawayCompressor" and route == "alltoall"
        print("reached")
    """)
    assert "reached" in run(plugin_env, "-c", script)
