"""labs.kit.data on the real MNIST test set, on corrupt copies of it, downloaded from a mirror on
127.0.0.1, the course's fallback to Fashion-MNIST, and sharding."""
import dataclasses
import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import MNIST_DIR
from labs.kit import data, download
from mirror import Mirror, refused_url

pytestmark = pytest.mark.unit

IMAGES = MNIST_DIR / "t10k-images-idx3-ubyte.gz"
LABELS = MNIST_DIR / "t10k-labels-idx1-ubyte.gz"

# Published facts about the MNIST test set (not our output): images per digit 0..9, and the
# first three labels (the familiar 7, 2, 1 of every MNIST tutorial).
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope="module")
def test_images():
    return data.read_idx(IMAGES, data.MNIST.test_images)


@pytest.fixture(scope="module")
def test_labels():
    return data.read_idx(LABELS, data.MNIST.test_labels)


def copy_test_set(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for path in (IMAGES, LABELS):
        shutil.copy(path, folder / path.name)
    return folder


# --- reading the real files ------------------------------------------------------------------

def test_real_test_set_parses(test_images, test_labels):
    assert test_images.shape == (10000, 28, 28) and test_images.dtype == np.uint8
    assert test_labels.shape == (10000,) and test_labels.dtype == np.uint8
    assert list(test_labels[:3]) == [7, 2, 1]
    assert np.bincount(test_labels, minlength=10).tolist() == MNIST_TEST_COUNTS
    assert test_images.min() == 0 and test_images.max() == 255


def test_published_md5_is_checked():
    assert data.md5_of(IMAGES) == data.MNIST.test_images.gz_md5
    content, how = data.verify_file(IMAGES, data.MNIST.test_images)
    assert "published .gz" in how
    assert len(content) == 16 + 10000 * 28 * 28


def test_recompressed_copy_is_accepted_by_content_md5(tmp_path, test_labels):
    # Debian re-compresses Fashion-MNIST: different .gz bytes, same IDX content.
    copy = tmp_path / LABELS.name
    copy.write_bytes(gzip.compress(gzip.decompress(LABELS.read_bytes()), mtime=12345))
    assert data.md5_of(copy) != data.MNIST.test_labels.gz_md5
    labels = data.read_idx(copy, data.MNIST.test_labels)
    assert np.array_equal(labels, test_labels)


def test_uncompressed_file_is_accepted(tmp_path, test_labels):
    raw = tmp_path / "t10k-labels-idx1-ubyte"
    raw.write_bytes(gzip.decompress(LABELS.read_bytes()))
    assert data.find_file(tmp_path, data.MNIST.test_labels) == raw
    assert np.array_equal(data.read_idx(raw, data.MNIST.test_labels), test_labels)


# --- corrupt and missing files ---------------------------------------------------------------

def test_truncated_gzip_is_a_clear_error(tmp_path):
    cut = tmp_path / IMAGES.name
    cut.write_bytes(IMAGES.read_bytes()[:100_000])
    with pytest.raises(data.DataError, match="truncated or corrupt"):
        data.read_idx(cut, data.MNIST.test_images)


def test_truncated_content_is_a_clear_error(tmp_path):
    content = gzip.decompress(IMAGES.read_bytes())[:-28 * 28]   # one image short
    with pytest.raises(data.DataError, match="truncated"):
        data.parse_idx(content, "cut")
    cut = tmp_path / IMAGES.name
    cut.write_bytes(gzip.compress(content, compresslevel=1))    # level 9 took 2 s; any will do
    with pytest.raises(data.DataError, match="checksum mismatch"):
        data.read_idx(cut, data.MNIST.test_images)


def test_wrong_md5_is_a_clear_error(tmp_path):
    content = bytearray(gzip.decompress(LABELS.read_bytes()))
    content[100] = (content[100] + 1) % 10          # a plausible but wrong label
    bad = tmp_path / LABELS.name
    bad.write_bytes(gzip.compress(bytes(content)))
    with pytest.raises(data.DataError) as err:
        data.read_idx(bad, data.MNIST.test_labels)
    message = str(err.value)
    assert "checksum mismatch" in message and data.MNIST.test_labels.gz_md5 in message


def test_not_an_idx_file(tmp_path):
    with pytest.raises(data.DataError, match="not an IDX file"):
        data.parse_idx(b"PK\x03\x04 a zip file", "zip")


def test_missing_folder_names_the_files_and_how_to_get_them(tmp_path):
    with pytest.raises(data.DataError) as err:
        data.load_dataset("mnist", str(tmp_path / "nowhere"))
    message = str(err.value)
    assert "t10k-images-idx3-ubyte.gz" in message and "--data-dir" in message


def test_missing_training_set_suggests_split_test_and_never_falls_back(tmp_path):
    folder = copy_test_set(tmp_path / "mnist")
    with pytest.raises(data.DataError) as err:
        data.load_dataset("mnist", str(folder), download=False)
    message = str(err.value)
    # only what is missing is listed, and the way out is named
    assert "could not find train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz in" in message
    assert "--split-test" in message


def test_missing_labels_file(tmp_path):
    folder = copy_test_set(tmp_path / "mnist")
    (folder / LABELS.name).unlink()
    with pytest.raises(data.DataError, match="t10k-labels-idx1-ubyte.gz"):
        data.load_dataset("mnist", str(folder), split_test=8000)


def test_corrupt_file_stops_load_dataset(tmp_path):
    folder = copy_test_set(tmp_path / "mnist")
    (folder / IMAGES.name).write_bytes(IMAGES.read_bytes()[:-10])
    with pytest.raises(data.DataError):
        data.load_dataset("mnist", str(folder), split_test=8000)


def test_unknown_dataset():
    with pytest.raises(data.DataError, match="unknown data set"):
        data.load_dataset("cifar10")


# --- loading and normalising -----------------------------------------------------------------

def test_split_test_trains_on_the_first_n_images(test_images, test_labels):
    loaded = data.load_dataset("mnist", str(MNIST_DIR), split_test=8000)
    assert loaded.train_x.shape == (8000, 1, 28, 28) and loaded.train_x.dtype == torch.float32
    assert loaded.test_x.shape == (2000, 1, 28, 28)
    assert torch.equal(loaded.train_y, torch.from_numpy(test_labels[:8000].astype(np.int64)))
    assert torch.equal(loaded.test_y, torch.from_numpy(test_labels[8000:].astype(np.int64)))
    # ToTensor() + Normalize((0.1307,), (0.3081,)), computed independently here
    expected = (test_images[8000].astype(np.float64) / 255 - 0.1307) / 0.3081
    assert np.allclose(loaded.test_x[0, 0].numpy(), expected, atol=1e-6)
    assert set(loaded.files) == {IMAGES.name, LABELS.name}
    assert loaded.describe()["train_samples"] == 8000


def test_torchvision_layout_is_found(tmp_path):
    copy_test_set(tmp_path / "root" / "MNIST" / "raw")
    loaded = data.load_dataset("mnist", str(tmp_path / "root"), split_test=5000)
    assert loaded.folder.endswith("MNIST/raw")


@pytest.mark.parametrize("n", [0, -1, 10000, 20000])
def test_split_test_out_of_range(n):
    with pytest.raises(data.DataError, match="--split-test"):
        data.load_dataset("mnist", str(MNIST_DIR), split_test=n)


# --- sharding --------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), size=st.integers(1, 8), epoch=st.integers(0, 5))
def test_eval_shards_cover_every_sample_exactly_once(n, size, epoch):
    if n < size:
        with pytest.raises(data.DataError, match="ranks"):
            data.eval_shard(n, 0, size)
        return
    shards = [data.eval_shard(n, r, size) for r in range(size)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), size=st.integers(1, 8), epoch=st.integers(0, 5),
       seed=st.integers(0, 2**31 - 1))
def test_train_shards_cover_all_samples_with_equal_lengths(n, size, epoch, seed):
    if n < size:
        with pytest.raises(data.DataError):
            data.train_shard(n, 0, size, seed, epoch)
        return
    shards = [data.train_shard(n, r, size, seed, epoch) for r in range(size)]
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1                       # same number of steps on every rank
    everything = torch.cat(shards).tolist()
    assert set(everything) == set(range(n))        # every sample is seen
    padding = len(everything) - n
    assert 0 <= padding < size                     # only the padding repeats samples
    assert len(set(everything)) == n


def test_train_shards_without_padding_are_a_partition():
    shards = [data.train_shard(60000, r, 4, seed=42, epoch=1) for r in range(4)]
    assert sorted(torch.cat(shards).tolist()) == list(range(60000))


def test_shuffle_is_deterministic_by_seed_and_epoch():
    a = data.train_shard(1000, 1, 2, seed=42, epoch=3)
    assert torch.equal(a, data.train_shard(1000, 1, 2, seed=42, epoch=3))
    assert not torch.equal(a, data.train_shard(1000, 1, 2, seed=42, epoch=4))
    assert not torch.equal(a, data.train_shard(1000, 1, 2, seed=7, epoch=3))


def test_more_ranks_than_samples_is_a_clear_error():
    with pytest.raises(data.DataError, match="3 samples but there are 4 ranks"):
        data.train_shard(3, 0, 4, seed=0, epoch=0)


def test_batches():
    sizes = [len(b) for b in data.batches(torch.arange(10), 4)]
    assert sizes == [4, 4, 2]
    with pytest.raises(ValueError):
        data.batches(torch.arange(10), 0)


# --- Fashion-MNIST from Debian's package (scripts/setup.sh installs it) ----------------------

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def test_debian_fashion_mnist_is_found_checked_and_normalised():
    assert (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file(), \
        "Debian's dataset-fashion-mnist is not installed: run scripts/setup.sh"
    loaded = data.load_dataset("fashion-mnist")
    assert Path(loaded.folder) == FASHION_DIR and loaded.note is None
    assert loaded.train_x.shape == (60000, 1, 28, 28) and loaded.test_x.shape == (10000, 1, 28, 28)
    # published: 6,000 training and 1,000 test images per class
    assert torch.bincount(loaded.train_y).tolist() == [6000] * 10
    assert torch.bincount(loaded.test_y).tolist() == [1000] * 10
    # Debian re-compressed the files: accepted by the MD5 of their content
    assert all("content md5" in how for how in loaded.files.values())
    # the mean/std constants normalise the training set to mean 0, std 1
    assert float(loaded.train_x.mean()) == pytest.approx(0.0, abs=1e-3)
    assert float(loaded.train_x.std()) == pytest.approx(1.0, abs=1e-3)


# --- MNIST downloaded, or the course's command falling back (a mirror on 127.0.0.1) ----------

def real_test_set():
    """The real t10k files, served with their published sums (the ones load_dataset checks)."""
    return {path.name: path.read_bytes() for path in (IMAGES, LABELS)}


def test_missing_mnist_is_downloaded_checked_and_loaded(tmp_path, monkeypatch, capsys):
    with Mirror(real_test_set()) as mirror:
        monkeypatch.setenv(download.MIRRORS_ENV, f"{refused_url()} {mirror.url}")
        loaded = data.load_dataset("mnist", str(tmp_path / "mnist"), split_test=9000)
        assert loaded.name == "mnist" and loaded.note is None
        assert Path(loaded.folder) == tmp_path / "mnist" and len(loaded.test_y) == 1000
        assert all("published .gz" in how for how in loaded.files.values())
        assert dict(mirror.requests) == {IMAGES.name: 1, LABELS.name: 1}
        data.load_dataset("mnist", str(tmp_path / "mnist"), split_test=9000)
        assert sum(mirror.requests.values()) == 2            # there now: not fetched again
    out = capsys.readouterr().out
    assert f"downloading {mirror.url}{IMAGES.name}: 1.6 of 1.6 MB (100%)" in out
    assert f"downloaded {tmp_path / 'mnist' / IMAGES.name} (1.6 MB" in out


def test_the_course_command_downloads_mnist_into_data(tmp_path, monkeypatch):
    """No --dataset, no --data-dir: MNIST is fetched into data/mnist of the current folder."""
    monkeypatch.chdir(tmp_path)
    with Mirror(real_test_set()) as mirror:
        monkeypatch.setenv(download.MIRRORS_ENV, mirror.url)
        loaded = data.load_dataset(split_test=8000)
    assert loaded.name == "mnist" and loaded.note is None
    assert Path(loaded.folder) == tmp_path / "data" / "mnist"
    assert loaded.train_y[:3].tolist() == [7, 2, 1]          # MNIST's first test digits


def test_offline_the_course_command_trains_on_fashion_mnist_and_says_why(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(download.MIRRORS_ENV, refused_url())
    loaded = data.load_dataset(split_test=8000)
    assert loaded.name == "fashion-mnist" and Path(loaded.folder) == FASHION_DIR
    note = loaded.note
    assert "\n" not in note and note.startswith("data: training on Fashion-MNIST")
    assert "could not be downloaded" in note and "Connection refused" in note
    assert "--data-dir" in note and "internet" in note
    assert loaded.describe()["note"] == note                  # into the run's manifest


def test_a_download_cut_half_way_falls_back_and_leaves_nothing(tmp_path, monkeypatch):
    """The mirror drops the connection half-way through the images: the course's command
    trains on Fashion-MNIST, saying so; no file is left where the next run would read it."""
    monkeypatch.chdir(tmp_path)
    with Mirror(real_test_set(), drop={IMAGES.name}) as mirror:
        monkeypatch.setenv(download.MIRRORS_ENV, mirror.url)
        loaded = data.load_dataset(split_test=8000)
        with pytest.raises(data.DataError) as err:            # asked for by name: no fallback
            data.load_dataset("mnist", split_test=8000)
    assert loaded.name == "fashion-mnist"
    assert "the connection closed after 824,438 of 1,648,877 bytes" in loaded.note
    assert "could not find t10k-images-idx3-ubyte.gz" in str(err.value)
    assert "failed: could not download t10k-images-idx3-ubyte.gz" in str(err.value)
    # this process met the failure already: said again, not tried again
    assert "met by process" in str(err.value) and mirror.requests[IMAGES.name] == 1
    assert not list((tmp_path / "data" / "mnist").glob("t10k*"))    # nor a .part file


def test_mnist_asked_for_by_name_or_folder_never_falls_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(download.MIRRORS_ENV, refused_url())
    for name, folder in (("mnist", None), (None, str(tmp_path / "mine"))):
        with pytest.raises(data.DataError, match="could not find .* Downloading them into"):
            data.load_dataset(name, folder, split_test=8000)


def test_mnist_found_in_data_is_used_without_asking_a_mirror(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    copy_test_set(tmp_path / "data" / "mnist")
    monkeypatch.setenv(download.MIRRORS_ENV, refused_url())  # would fail if it were asked
    loaded = data.load_dataset(split_test=8000)
    assert loaded.name == "mnist" and loaded.note is None


def test_only_mnists_test_set_in_data_says_how_to_use_it(tmp_path, monkeypatch):
    """The course's command without --split-test where data/mnist holds the test set only:
    Fashion-MNIST offline, and the line says --split-test would train on MNIST's."""
    monkeypatch.chdir(tmp_path)
    copy_test_set(tmp_path / "data" / "mnist")
    monkeypatch.setenv(download.MIRRORS_ENV, "")
    loaded = data.load_dataset()
    assert loaded.name == "fashion-mnist" and "add --split-test N" in loaded.note
    assert "downloads are off" in loaded.note


def test_a_corrupt_mnist_file_found_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = copy_test_set(tmp_path / "data" / "mnist")
    (folder / LABELS.name).write_bytes(LABELS.read_bytes()[:-10])
    with pytest.raises(data.DataError, match="t10k-labels"):
        data.load_dataset(split_test=8000)


def test_no_mnist_and_no_fashion_mnist_says_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data, "FASHION_MNIST", dataclasses.replace(
        data.FASHION_MNIST, default_dirs=(str(tmp_path / "none"),)))
    with pytest.raises(data.DataError) as err:
        data.load_dataset(split_test=8000)
    message = str(err.value)
    assert "mnist: could not find" in message and "downloads are off" in message
    assert "Fashion-MNIST, the lab's offline fallback, is missing too" in message
    assert "apt-get install" in message
