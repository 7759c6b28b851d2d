"""Before a run trains: settings and checks every rank must share, or the job hangs.

A rank that fails alone (a missing file, a bad flag for this launcher) would leave the others
waiting forever in their next collective; `agree` turns one rank's error into every rank's.
"""
import os
import sys

import horovod.torch as hvd

from . import data as lab_data

# Horovod settings that make a broken job end instead of hanging; set before hvd.init() only
# where the user (or horovodrun --gloo-timeout-seconds / --stall-check-*) has not.
HOROVOD_DEFAULTS = {
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",          # Gloo gives up on a silent peer (stock: 30)
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",      # warn when ranks wait on a tensor others skip
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",  # ... and shut Horovod down (stock: never)
}


def set_horovod_defaults(environ=os.environ):
    """HOROVOD_DEFAULTS where unset; returns the values in force (for the manifest)."""
    for name, value in HOROVOD_DEFAULTS.items():
        environ.setdefault(name, value)
    return horovod_settings(environ)


def horovod_settings(environ=os.environ):
    return {name: environ.get(name) for name in HOROVOD_DEFAULTS}   # None: not a Horovod job


def _engine(engine):
    """The collectives the lab kit uses: Horovod's unless a trainer passes another engine
    (labs/ddp_mnist.py passes torch.distributed's)."""
    if engine is not None:
        return engine
    from hvd_compress.engine.horovod import horovod_engine
    return horovod_engine()


def agree(error, engine=None):
    """Every rank passes its error message (or None); if any rank has one, rank 0 prints the
    first and every rank exits with code 2."""
    engine = _engine(engine)
    errors = [e for e in engine.allgather_object(error, None) if e]
    if errors:
        if engine.rank() == 0:
            print(f"error: {errors[0]}", file=sys.stderr, flush=True)
        sys.exit(2)


def load_data(args, device, engine=None):
    """args.dataset read by every rank (md5-checked) into normalised tensors on `device`; a
    missing or corrupt file, or fewer samples than ranks, is every rank's error.  Without
    --dataset, MNIST is found or downloaded (one rank at a time: a lock in the data folder, so
    the first downloads and the others find its files), else Fashion-MNIST: rank 0 says so in
    one line, and args.dataset becomes the data set every rank loaded. With --holdout K the
    training set's last K images are set aside (lab_data.hold_out)."""
    data, error, engine = None, None, _engine(engine)
    try:
        data = lab_data.load_dataset(args.dataset, args.data_dir, args.split_test)
        if getattr(args, "holdout", None):
            data = lab_data.hold_out(data, args.holdout)
            lab_data.check_world(len(data.holdout_y), engine.size(), "the held-out split")
        lab_data.check_world(len(data.train_y), engine.size(), "the training set")
        lab_data.check_world(len(data.test_y), engine.size(), "the test set")
    except lab_data.DataError as err:
        error = str(err)
    agree(error, engine)
    names = engine.allgather_object(data.name, "data_set")
    agree(None if len(set(names)) == 1 else
          "the processes found different data sets (" + ", ".join(
              f"rank {r}: {n}" for r, n in enumerate(names)) + "): give every one the same "
          "MNIST files (--data-dir) or --dataset", engine)
    if data.note and engine.rank() == 0:
        print(data.note, flush=True)
    args.dataset = data.name
    for name in ("train_x", "train_y", "test_x", "test_y", "holdout_x", "holdout_y"):
        if getattr(data, name) is not None:                  # the whole set fits on a GPU
            setattr(data, name, getattr(data, name).to(device))
    return data
