"""MNIST-style data for the course lab: find the IDX files, check them, read them, shard them.

Why this module exists: torchvision is not installable beside the torch we use, and the lab
must run offline.  Everything here is plain NumPy/torch:

* ``read_idx``      parses the IDX format (the big-endian format MNIST is published in).
* ``verify_file``   checks a file against the published MD5 sum, so a truncated download or
                    a different data set is reported instead of silently trained on.
* ``load_dataset``  returns normalised float tensors, loaded once (no per-sample transform);
                    MNIST missing is downloaded (labs/kit/download.py) where the machine is
                    online.
* ``hold_out``      sets the training set's last images aside, a validation split to
                    evaluate on while training (steps to a target accuracy), not the test set.
* ``train_shard`` / ``eval_shard`` split sample indices across Horovod ranks the way
                    ``torch.utils.data.DistributedSampler`` does, deterministically.

Missing or corrupt data raises ``DataError`` with instructions.  One fallback, for the course's
command as typed (no --dataset, no --data-dir): where MNIST can be neither found nor
downloaded, Fashion-MNIST from Debian's package, and the loaded data's ``note`` says so.
"""
from __future__ import annotations

import gzip
import hashlib
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .download import DownloadError, fetch as download_files


class DataError(RuntimeError):
    """The data set is missing, corrupt or unusable; the message says how to fix it."""


# ---------------------------------------------------------------------------------------------
# Data set descriptions
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IdxFile:
    """One published file: its name, the MD5 of the published .gz, and the MD5 of its content.

    The content MD5 (of the uncompressed IDX bytes) lets us accept a re-compressed copy,
    e.g. Debian's ``dataset-fashion-mnist`` whose .gz files differ only in gzip headers.
    """
    name: str            # without ".gz"
    gz_md5: str
    content_md5: str
    count: int           # number of images / labels in the file


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    train_images: IdxFile
    train_labels: IdxFile
    test_images: IdxFile
    test_labels: IdxFile
    mean: float          # of pixel/255 over the training set
    std: float
    default_dirs: tuple  # searched in order when --data-dir is not given
    how_to_get: str
    classes: tuple = field(default=tuple(str(i) for i in range(10)))


MNIST = DatasetSpec(
    name="mnist",
    # Sums published with the MNIST database (the ones torchvision checks).
    train_images=IdxFile("train-images-idx3-ubyte", "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                         "6bbc9ace898e44ae57da46a324031adb", 60000),
    train_labels=IdxFile("train-labels-idx1-ubyte", "d53e105ee54ea40749a09fcbcd1e9432",
                         "a25bea736e30d166cdddb491f175f624", 60000),
    test_images=IdxFile("t10k-images-idx3-ubyte", "9fb629c4189551a2d022fa330f9573f3",
                        "2646ac647ad5339dbf082846283269ea", 10000),
    test_labels=IdxFile("t10k-labels-idx1-ubyte", "ec29112dd5afa0611ce80d1b7f02629c",
                        "27ae3e4e09519cfbb04c329615203637", 10000),
    mean=0.1307, std=0.3081,   # the values of PyTorch's and Horovod's MNIST examples
    default_dirs=("data/MNIST/raw", "data/mnist", "data"),
    how_to_get=(
        "Put the four MNIST files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
        "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) in one folder and pass "
        "--data-dir FOLDER; with only the two t10k files, add --split-test N. On a machine "
        "with internet access they are downloaded into --data-dir (default data/mnist) from "
        "torchvision's mirrors. Offline, --dataset fashion-mnist uses Debian's package "
        "(apt-get install dataset-fashion-mnist)."),
)

FASHION_MNIST = DatasetSpec(
    name="fashion-mnist",
    # .gz sums from Zalando's README; content sums of the same files, uncompressed.
    train_images=IdxFile("train-images-idx3-ubyte", "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                         "f4a8712d7a061bf5bd6d2ca38dc4d50a", 60000),
    train_labels=IdxFile("train-labels-idx1-ubyte", "25c81989df183df01b3e8a0aad5dffbe",
                         "9018921c3c673c538a1fc5bad174d6f9", 60000),
    test_images=IdxFile("t10k-images-idx3-ubyte", "bef4ecab320f06d8554ea6380940ec79",
                        "8181f5470baa50b63fa0f6fddb340f0a", 10000),
    test_labels=IdxFile("t10k-labels-idx1-ubyte", "bb300cfdad3c16e7a12a480ee83cd310",
                        "15d484375f8d13e6eb1aabb0c3f46965", 10000),
    mean=0.2860, std=0.3530,   # measured on the 60,000 training images
    default_dirs=("/usr/share/datasets/fashion-mnist", "data/fashion-mnist"),
    how_to_get=(
        "Install Debian's package: apt-get install -y dataset-fashion-mnist (it puts the "
        "four files in /usr/share/datasets/fashion-mnist), or pass --data-dir FOLDER "
        "holding the four Fashion-MNIST IDX .gz files."),
    classes=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
             "Sneaker", "Bag", "Ankle boot"),
)

DATASETS = {spec.name: spec for spec in (MNIST, FASHION_MNIST)}
# Where MNIST is downloaded when --data-dir is not given (one of MNIST.default_dirs).
DOWNLOAD_DIR = "data/mnist"


# ---------------------------------------------------------------------------------------------
# Files: locate, checksum, parse
# ---------------------------------------------------------------------------------------------

def md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_file(folder: Path, idx: IdxFile) -> Optional[Path]:
    """The .gz of ``idx`` in ``folder`` (or the uncompressed file), None if neither exists."""
    for candidate in (folder / f"{idx.name}.gz", folder / idx.name):
        if candidate.is_file():
            return candidate
    return None


def _decompress(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:
        raise DataError(f"{path}: not a complete gzip file ({err}); the file is truncated "
                        f"or corrupt, get it again") from err


def verify_file(path: Path, idx: IdxFile, how_to_get: str = "") -> tuple[bytes, str]:
    """Check ``path`` against the published sums; return (uncompressed bytes, how it matched).

    A .gz matches if its own MD5 is the published one, or if its content's MD5 is (a
    re-compressed copy).  An uncompressed file must match the content MD5.
    """
    if path.suffix == ".gz":
        file_md5 = md5_of(path)
        if file_md5 == idx.gz_md5:
            return _decompress(path), f"md5 {file_md5} (published .gz)"
        content = _decompress(path)
    else:
        file_md5 = None
        content = path.read_bytes()
    content_md5 = hashlib.md5(content).hexdigest()
    if content_md5 == idx.content_md5:
        return content, f"content md5 {content_md5} (published file, re-compressed)"
    found = f"md5 {file_md5}, content md5 {content_md5}" if file_md5 else f"md5 {content_md5}"
    raise DataError(
        f"{path}: checksum mismatch ({found}); expected {idx.gz_md5} for {idx.name}.gz "
        f"or content md5 {idx.content_md5}. The file is corrupt, truncated or from another "
        f"data set. {how_to_get}".strip())


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def parse_idx(content: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse IDX bytes: 2 zero bytes, a dtype code, the number of dims, big-endian int32 dims,
    then the data.  Raises DataError on any inconsistency (e.g. a truncated file)."""
    if len(content) < 4 or content[0] != 0 or content[1] != 0:
        raise DataError(f"{source}: not an IDX file (bad magic number)")
    dtype_code, ndim = content[2], content[3]
    if dtype_code not in _IDX_DTYPES or ndim == 0:
        raise DataError(f"{source}: not an IDX file (type 0x{dtype_code:02x}, {ndim} dims)")
    header = 4 + 4 * ndim
    if len(content) < header:
        raise DataError(f"{source}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(content, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[dtype_code])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(content) != expected:
        raise DataError(f"{source}: IDX header says {dims} ({expected} bytes) but the file "
                        f"has {len(content)} bytes; it is truncated or corrupt")
    return np.frombuffer(content, dtype=dtype, offset=header).reshape(dims).astype(
        dtype.newbyteorder("="), copy=True)


def read_idx(path: Path, idx: Optional[IdxFile] = None, how_to_get: str = "") -> np.ndarray:
    """Read one IDX file (gzipped or not), checking its MD5 when ``idx`` is given."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found. {how_to_get}".strip())
    if idx is not None:
        content, _ = verify_file(path, idx, how_to_get)
    else:
        content = _decompress(path)
    array = parse_idx(content, str(path))
    if idx is not None and array.shape[0] != idx.count:
        raise DataError(f"{path}: {array.shape[0]} records, expected {idx.count}")
    return array


# ---------------------------------------------------------------------------------------------
# Data set loading
# ---------------------------------------------------------------------------------------------

@dataclass
class LoadedData:
    """Normalised tensors ready for the step loop, plus where they came from (for the manifest)."""
    name: str
    folder: str
    train_x: torch.Tensor      # float32 N x 1 x 28 x 28
    train_y: torch.Tensor      # int64 N
    test_x: torch.Tensor
    test_y: torch.Tensor
    files: dict                # file name -> how its checksum matched
    split_test: Optional[int]
    mean: float
    std: float
    note: Optional[str] = None  # why this data set and not the one asked for (the fallback)
    holdout_x: Optional[torch.Tensor] = None    # hold_out(): images set aside from training
    holdout_y: Optional[torch.Tensor] = None

    def describe(self) -> dict:
        return {"name": self.name, "folder": self.folder, "files": self.files,
                "split_test": self.split_test, "train_samples": len(self.train_y),
                "holdout_samples": 0 if self.holdout_y is None else len(self.holdout_y),
                "test_samples": len(self.test_y), "mean": self.mean, "std": self.std,
                "note": self.note}


def normalise(images: np.ndarray, mean: float, std: float) -> torch.Tensor:
    """uint8 N x 28 x 28 -> float32 N x 1 x 28 x 28, ((x/255) - mean)/std like the course's
    transforms.ToTensor() + Normalize(), done once for the whole array."""
    x = torch.from_numpy(images).to(torch.float32).div_(255.0).sub_(mean).div_(std)
    return x.unsqueeze(1).contiguous()


def _candidate_dirs(spec: DatasetSpec, data_dir: Optional[str]) -> list[Path]:
    if data_dir:
        root = Path(data_dir).expanduser()
        # Also accept torchvision's layout (<root>/MNIST/raw) and a per-data-set subfolder.
        return [root, root / "MNIST" / "raw", root / "FashionMNIST" / "raw", root / spec.name]
    return [Path(d) for d in spec.default_dirs]


def _needed(spec: DatasetSpec, need_train: bool) -> list[IdxFile]:
    needed = [spec.test_images, spec.test_labels]
    return [spec.train_images, spec.train_labels] + needed if need_train else needed


def _only_test_set_hint(spec: DatasetSpec, candidates: list[Path], need_train: bool) -> str:
    if need_train and any(find_file(f, spec.test_images) for f in candidates):
        return " (only the test set was found: add --split-test N to train on part of it)"
    return ""


def locate(spec: DatasetSpec, data_dir: Optional[str], need_train: bool) -> Path:
    """The first candidate folder holding the files we need; DataError listing what is missing."""
    needed = _needed(spec, need_train)
    candidates = _candidate_dirs(spec, data_dir)
    for folder in candidates:
        if all(find_file(folder, idx) for idx in needed):
            return folder
    looked = ", ".join(str(c) for c in candidates)
    best = max(candidates, key=lambda folder: sum(bool(find_file(folder, i)) for i in needed))
    missing = ", ".join(f"{idx.name}.gz" for idx in needed if not find_file(best, idx))
    raise DataError(f"{spec.name}: could not find {missing} in {looked}"
                    f"{_only_test_set_hint(spec, candidates, need_train)}. {spec.how_to_get}")


class NotDownloaded(DataError):
    """MNIST is not where we looked, and downloading it failed (``reason``: why, in a line)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def find_or_fetch(spec: DatasetSpec, data_dir: Optional[str], need_train: bool,
                  fetch: bool = True) -> Path:
    """The folder holding the files we need; MNIST's missing ones are first downloaded (with
    ``fetch``) into ``data_dir``, or DOWNLOAD_DIR without one.  Only MNIST: Fashion-MNIST comes
    from Debian, offline."""
    try:
        return locate(spec, data_dir, need_train)
    except DataError as missing:
        if not (fetch and spec.name == MNIST.name):
            raise
        target = Path(data_dir).expanduser() if data_dir else Path(DOWNLOAD_DIR)
        sums = {f"{idx.name}.gz": idx.gz_md5 for idx in _needed(spec, need_train)
                if not find_file(target, idx)}
        try:
            download_files(target, sums)
        except DownloadError as err:
            raise NotDownloaded(f"{missing} Downloading them into {target} failed: {err}",
                                str(err)) from err
        return locate(spec, str(target), need_train)


def fallback_note(missing: DataError, fashion_folder: Path, need_train: bool) -> str:
    """The one line that says the lab trains on Fashion-MNIST, why, and how to get MNIST."""
    looked = ", ".join(str(c) for c in _candidate_dirs(MNIST, None))
    why = (f" and could not be downloaded ({missing.reason})"
           if isinstance(missing, NotDownloaded) else "")
    hint = _only_test_set_hint(MNIST, _candidate_dirs(MNIST, None), need_train)
    return (f"data: training on Fashion-MNIST ({fashion_folder}), not MNIST: MNIST is not in "
            f"{looked}{hint}{why}. For MNIST, pass --data-dir "
            f"FOLDER holding its IDX .gz files, or run once on a machine with internet access "
            f"(they go to {DOWNLOAD_DIR}).")


def load_dataset(name: Optional[str] = None, data_dir: Optional[str] = None,
                 split_test: Optional[int] = None, download: bool = True) -> LoadedData:
    """Load a data set as normalised tensors.

    ``name=None`` is the course's command as typed: MNIST where it is found or can be
    downloaded, else Fashion-MNIST from Debian's package, with ``note`` saying so in a line.
    A name or a ``data_dir`` given is what the user asked for: missing, it is an error.
    ``split_test=N`` trains on the first N test images and evaluates on the other ones (only
    the two t10k files are needed then).
    """
    if name is not None and name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; choose from {sorted(DATASETS)}")
    spec = DATASETS[name or MNIST.name]
    if split_test is not None and not 0 < split_test < spec.test_images.count:
        raise DataError(f"--split-test must be between 1 and {spec.test_images.count - 1} "
                        f"(the test set has {spec.test_images.count} images), got {split_test}")
    need_train = split_test is None
    note = None
    try:
        folder = find_or_fetch(spec, data_dir, need_train, download)
    except DataError as missing:
        if name is not None or data_dir:
            raise
        try:
            folder = locate(FASHION_MNIST, None, need_train)
        except DataError as no_fashion:
            raise DataError(f"{missing} Fashion-MNIST, the lab's offline fallback, is missing "
                            f"too: {no_fashion}") from missing
        spec, note = FASHION_MNIST, fallback_note(missing, folder, need_train)

    files = {}

    def read(idx: IdxFile) -> np.ndarray:
        path = find_file(folder, idx)
        content, how = verify_file(path, idx, spec.how_to_get)
        files[path.name] = how
        array = parse_idx(content, str(path))
        if array.shape[0] != idx.count:
            raise DataError(f"{path}: {array.shape[0]} records, expected {idx.count}")
        return array

    test_images, test_labels = read(spec.test_images), read(spec.test_labels)
    if split_test is None:
        train_images, train_labels = read(spec.train_images), read(spec.train_labels)
    else:
        train_images, train_labels = test_images[:split_test], test_labels[:split_test]
        test_images, test_labels = test_images[split_test:], test_labels[split_test:]

    return LoadedData(
        name=spec.name, folder=str(folder.resolve()),
        train_x=normalise(train_images, spec.mean, spec.std),
        train_y=torch.from_numpy(train_labels.astype(np.int64)),
        test_x=normalise(test_images, spec.mean, spec.std),
        test_y=torch.from_numpy(test_labels.astype(np.int64)),
        files=files, split_test=split_test, mean=spec.mean, std=spec.std, note=note)


def hold_out(data: LoadedData, count: int) -> LoadedData:
    """``data`` with the last ``count`` training images set aside as ``holdout_x/_y``: a
    validation split, scored while training to count the steps to a target accuracy, so that
    the test set is never what a run is stopped or compared by. The last ones, the same for
    every seed: the published training sets are in no class order, so the tail is as mixed
    as the whole."""
    total = len(data.train_y)
    if not 0 < count < total:
        raise DataError(f"--holdout must be between 1 and {total - 1} (the training set has "
                        f"{total} images), got {count}")
    keep = total - count
    return replace(data, train_x=data.train_x[:keep], train_y=data.train_y[:keep],
                   holdout_x=data.train_x[keep:], holdout_y=data.train_y[keep:])


# ---------------------------------------------------------------------------------------------
# Sharding across ranks
# ---------------------------------------------------------------------------------------------

def check_world(n_samples: int, world_size: int, what: str) -> None:
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if n_samples < world_size:
        raise DataError(f"{what} has {n_samples} samples but there are {world_size} ranks: "
                        f"every rank needs at least one sample; use fewer processes or more data")


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of one epoch: a pure function of (seed, epoch), same on every rank."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)   # DistributedSampler's choice
    return torch.randperm(n_samples, generator=generator)


def train_shard(n_samples: int, rank: int, world_size: int, seed: int, epoch: int,
                shuffle: bool = True) -> torch.Tensor:
    """This rank's training indices for ``epoch`` (DistributedSampler semantics).

    The epoch's order is padded by repeating its first indices up to a multiple of the world
    size, so every rank gets the same number of samples and hence runs the same number of
    steps: each step is a collective, and a rank with one step fewer would hang the others.
    Rank r takes positions r, r + world_size, ...
    """
    check_world(n_samples, world_size, "the training set")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    order = epoch_permutation(n_samples, seed, epoch) if shuffle else torch.arange(n_samples)
    per_rank = math.ceil(n_samples / world_size)
    padding = per_rank * world_size - n_samples
    if padding:
        order = torch.cat([order, order[:padding]])
    return order[rank::world_size]


def eval_shard(n_samples: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's evaluation indices: a contiguous block, every sample exactly once overall,
    so summed-then-allreduced metrics are exactly those of the whole test set."""
    check_world(n_samples, world_size, "the test set")
    bounds = np.linspace(0, n_samples, world_size + 1).round().astype(int)
    return torch.arange(int(bounds[rank]), int(bounds[rank + 1]))


def batches(indices: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Split ``indices`` into consecutive batches (the last one may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return list(torch.split(indices, batch_size))
