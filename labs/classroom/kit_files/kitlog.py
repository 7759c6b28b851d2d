"""Logging for the course's trainer (given: call it, do not change it).

    log = kitlog.TrainLog(args.log_dir)
    log.step(epoch, step, seconds, loss)            # after every optimizer step
    log.epoch(epoch, test_loss, test_accuracy)      # after every evaluation (accuracy in 0..1)

It writes steps-rank<R>.csv and epochs-rank<R>.csv into the folder, R being the Horovod rank
(0 before hvd.init() or without Horovod). The grader and your report read them.
"""
import csv
import os


def _rank_and_size():
    try:
        import horovod.torch as hvd
        if hvd.is_initialized():
            return hvd.rank(), hvd.size()
    except (ImportError, ValueError):
        pass
    return 0, 1


class TrainLog:
    def __init__(self, folder):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.rank, self.size = _rank_and_size()
        self._files = {}

    def _write(self, kind, fields, row):
        if kind not in self._files:
            path = os.path.join(self.folder, f"{kind}-rank{self.rank}.csv")
            handle = open(path, "w", newline="")
            writer = csv.writer(handle)
            writer.writerow(fields)
            self._files[kind] = (handle, writer)
        handle, writer = self._files[kind]
        writer.writerow(row)
        handle.flush()

    def step(self, epoch, step, seconds, loss):
        self._write("steps", ["epoch", "step", "seconds", "loss", "size"],
                    [epoch, step, f"{seconds:.6f}", f"{float(loss):.6f}", self.size])

    def epoch(self, epoch, test_loss, test_accuracy):
        self._write("epochs", ["epoch", "test_loss", "test_accuracy", "size"],
                    [epoch, f"{float(test_loss):.6f}", f"{float(test_accuracy):.6f}", self.size])
