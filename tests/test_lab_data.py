"""The course's command as typed (`horovodrun -n 2 python labs/mnist.py --bit8-allreduce` and the
serial `python labs/mnist.py`), with a step limit (--max-steps 3), in a folder of its own: where
no MNIST can be had it trains on Fashion-MNIST and says so; where a mirror serves MNIST (on
127.0.0.1) one rank downloads it and both train on it; where the files are in data/mnist, they
are used. Four launches, two side by side, made once when the module's first test asks."""
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

from conftest import MNIST_DIR, ROOT
from labs.kit import download
from labs.kit.launch import launch_env
from mirror import Mirror, refused_url

pytestmark = pytest.mark.multiprocess

# The card's argv; the trainer by its path, as the run's folder is not the checkout (its data/
# must not be the checkout's). The step limit keeps each launch to start-up and three steps.
CARD = ["python", str(ROOT / "labs" / "mnist.py")]
NP2 = ["horovodrun", "-n", "2"]
STEPS = ["--max-steps", "3"]
FALLBACK = "data: training on Fashion-MNIST"
TEST_SET = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def launch(folder, argv, mirrors):
    """argv run in `folder` (made empty), MNIST's mirrors as given; the CompletedProcess and
    the one run folder it made."""
    folder.mkdir(parents=True, exist_ok=True)
    env = launch_env()
    env[download.MIRRORS_ENV] = mirrors
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)
    runs = sorted((folder / "runs").glob("*")) if (folder / "runs").is_dir() else []
    return done, runs


@pytest.fixture(scope="module")
def card_runs(tmp_path_factory):
    """{name: (CompletedProcess, [run folders], mirror requests after it)} of the four launches:
    offline (a mirror that refuses connections) on 2 ranks and serially; then, in one folder, 2
    ranks downloading the MNIST test set from a mirror on 127.0.0.1 and a serial run finding it
    there (--split-test 8000: the mirror has the test set only)."""
    base = tmp_path_factory.mktemp("card")
    offline = refused_url()
    mnist_files = {name: (MNIST_DIR / name).read_bytes() for name in TEST_SET}
    with Mirror(mnist_files) as mirror:
        def offline_runs():
            return {name: (*launch(base / name, argv + STEPS, offline), None) for name, argv in
                    (("offline-np2", NP2 + CARD + ["--bit8-allreduce"]),
                     ("offline-serial", CARD))}

        def mnist_runs():                       # one after the other, in the same folder
            return {name: (*launch(base / "mnist", argv + ["--split-test", "8000"] + STEPS,
                                   mirror.url), dict(mirror.requests)) for name, argv in
                    (("download-np2", NP2 + CARD + ["--bit8-allreduce"]),
                     ("local-serial", CARD))}
        with ThreadPoolExecutor(max_workers=2) as pool:
            parts = [pool.submit(offline_runs), pool.submit(mnist_runs)]
            made = {name: run for part in parts for name, run in part.result().items()}
    return made, base


def manifest_of(runs):
    assert len(runs) == 1, runs
    return json.loads((runs[0] / "manifest.json").read_text())


def output(done):
    return done.stdout + done.stderr


@pytest.mark.parametrize("name,ranks", [("offline-np2", 2), ("offline-serial", 1)])
def test_offline_the_card_trains_on_fashion_mnist_and_says_so_once(card_runs, name, ranks):
    made, base = card_runs
    done, runs, _ = made[name]
    text = output(done)
    assert done.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    assert text.count(FALLBACK) == 1                     # one line, from rank 0 only
    line = next(line for line in text.splitlines() if FALLBACK in line)
    assert "could not be downloaded" in line and "Connection refused" in line
    assert "--data-dir" in line and "internet access" in line
    assert text.index(FALLBACK) < text.index("run folder")    # at the start
    manifest = manifest_of(runs)
    assert runs[0].name.startswith(("np2-bit8" if ranks == 2 else "serial") + "-fashion-mnist-")
    assert manifest["data"]["name"] == manifest["args"]["dataset"] == "fashion-mnist"
    assert manifest["data"]["note"].startswith(FALLBACK)
    assert manifest["data"]["train_samples"] == 60000 and manifest["world_size"] == ranks
    assert len(pd.read_csv(runs[0] / "steps_rank0.csv")) == 3
    # --max-steps: a stop asked for, exit code 0, and how to go on
    assert manifest["status"] == "interrupted" and "--max-steps 3" in manifest["reason"]
    assert f"continue it with --out {runs[0].relative_to(base / name)} --resume" in text
    # nothing of MNIST was left in the folder the download would have used
    assert not list((base / name / "data" / "mnist").glob("*.gz*"))


def test_online_one_rank_downloads_mnist_and_both_train_on_it(card_runs):
    made, base = card_runs
    done, runs, requests = made["download-np2"]
    text = output(done)
    assert done.returncode == 0, text[-3000:]
    assert requests == {name: 1 for name in TEST_SET}           # each file fetched once
    for name in TEST_SET:
        assert text.count(f"downloaded data/mnist/{name} (") == 1
    assert "t10k-images-idx3-ubyte.gz: 1.6 of 1.6 MB (100%)" in text
    assert FALLBACK not in text
    manifest = manifest_of(runs)
    assert manifest["data"]["name"] == manifest["args"]["dataset"] == "mnist"
    assert manifest["data"]["note"] is None and manifest["world_size"] == 2
    assert manifest["data"]["folder"] == str(base / "mnist" / "data" / "mnist")
    assert set(manifest["data"]["files"]) == set(TEST_SET)
    assert runs[0].name.startswith("np2-bit8-mnist-")


def test_mnist_in_data_is_used_without_a_download(card_runs):
    made, base = card_runs
    done, runs, requests = made["local-serial"]
    text = output(done)
    assert done.returncode == 0, text[-3000:]
    assert requests == {name: 1 for name in TEST_SET}           # none more than the download's
    assert "downloading" not in text and FALLBACK not in text
    serial = [r for r in runs if r.name.startswith("serial-")]
    manifest = manifest_of(serial)
    assert manifest["data"]["name"] == "mnist" and manifest["data"]["note"] is None
    assert manifest["data"]["split_test"] == 8000
