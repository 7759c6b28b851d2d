"""The run recorder: a training run's folder, records, checkpoints, --resume and watchdog.

labs/mnist.py trains; the recorder keeps the books, in a few calls:

    run = RunRecorder(args, config_name(args, hvd.size()))  # the run folder (rank 0 decides)
    first_epoch = run.resume(model, optimizer)              # 1, or after --resume's checkpoint
    with run.recording(optimizer, data):                    # manifest, CSV files, watchdog
        for step in run.steps(epoch, batches, validate): ...  # one timed row per training step
        run.end_epoch(epoch, test_metrics, model, optimizer)  # epochs.csv, checkpoint

A run writes only into its folder (--out, default runs/<config>-<dataset>-<time>):
    steps_rank<r>.csv  one row per training step of rank r (written while training)
    steps.csv          all ranks' rows, merged by rank 0 at the end
    epochs.csv         one row per epoch: test loss/accuracy, epoch time, samples/s
    evals.csv          one row per evaluation on the held-out split (--holdout, --eval-every)
    manifest.json      arguments, world size, versions, machine, status (labs/kit/manifest.py)
    checkpoint.pt      model + optimizer + RNG state after the last finished epoch
    pids/rank<r>.pid   how tests and users find every process of a run

A run that stops early (SIGTERM, Ctrl-C, --max-steps) is recorded as 'interrupted' and exits
with code 3, or 0 for --max-steps (a stop asked for); --resume continues it from its last
checkpoint (from the start, the same seed giving the same weights and data order, if no epoch
had ended), dropping the rows written after it, so every row appears once.  A rank that hangs
is caught by the watchdog (exit code 75).
"""
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import horovod.torch as hvd

from hvd_compress.exchange.routes import horovod_bytes_sent
from labs.netem.launch import link_probe, wire_counter

from . import manifest, runlog
from .progress import Progress
from hvd_compress.engine.base import SUM

from .ranks import _engine, agree
from .watchdog import FLOOR_S, PERIOD_S, StepWatchdog, gloo_ceiling, suspects

# A peer killed a moment ago: the kernel closes its sockets (and our collective fails) before
# its process shows as exited in /proc, so a diagnosis that names nobody is asked again, for at
# most this long: two of the watchdog's periods, since a loaded machine (load 10 and more on
# 2 cores) delays the thread that writes the heartbeats (test_lab_failures' gloo-kill case
# recorded no cause within 1 s there); with the emulated network's 2 s wait for fresh
# heartbeats, still inside the launcher's 5 s grace before its SIGKILL.
DEAD_PEER_WAIT_S = 2 * PERIOD_S

NO_STATS = {"copy_s": math.nan, "compress_s": math.nan, "communicate_s": math.nan,
            "decompress_s": math.nan, "bytes_sent": math.nan, "exchange_s": math.nan, "launch_span_s": math.nan}


class Interrupted(Exception):
    """The run was stopped before its last epoch (signal or --max-steps); it can be resumed."""


class StepLimit(Interrupted):
    """--max-steps reached: every rank stops at the same step, as asked (exit code 0)."""


class TargetReached(Exception):
    """--target-accuracy reached on the held-out split: the run is complete (exit code 0)."""


class Step:
    """One training step as the loop sees it: its batch, a timer for its phases, its loss."""

    def __init__(self, index, timer):
        self.index, self.timer, self.loss = index, timer, math.nan


class RunRecorder:
    def __init__(self, args, config, engine=None):
        """Rank 0 picks the run folder (refusing one that holds another run, or one that
        --resume cannot continue); every rank writes its pid file there. `engine`: the
        collectives (hvd_compress/engine/), Horovod's unless given (labs/ddp_mnist.py)."""
        self.args, self.config = args, config
        self.engine = _engine(engine)
        self.rank, self.size = self.engine.rank(), self.engine.size()
        self.run_dir = self._agree_on_folder()
        runlog.atomic_write_text(self.run_dir / "pids" / f"rank{self.rank}.pid",
                                 f"{os.getpid()}\n")
        self.step = 0                   # training steps so far, over all epochs
        self.samples = 0                # training images this rank has stepped on so far
        self.first_epoch, self.dropped = 1, 0
        self.optimizer = self.steps_log = self.epochs_log = self.evals_log = None
        self.watchdog = None
        self._fixed_stats, self._train = dict(NO_STATS), None
        self._validation_s = 0.0        # this epoch's evaluations of the held-out split
        self.plans = False              # set by recording(): the optimizer plans per bucket
        self._wire = wire_counter()     # bytes on this rank's emulated link, read per epoch

    # ---- the run folder and --resume ---------------------------------------------------------

    def _agree_on_folder(self):
        args, decision = self.args, None
        if self.rank == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = Path(args.out) if args.out else Path("runs") / (
                f"{self.config}-{args.dataset}-{stamp}")
            decision = self._refusal(out) or {"run_dir": str(out)}
            if "run_dir" in decision:
                out.mkdir(parents=True, exist_ok=True)
        decision = self.engine.broadcast_object(decision, root_rank=0, name="run_dir")
        agree(decision.get("error"), self.engine)
        return Path(decision["run_dir"])

    def _refusal(self, out):
        """{'error': why} if `out` cannot be used, None if it can."""
        if not self.args.resume:
            if out.exists() and any(out.iterdir()):
                return {"error": f"{out} already holds a run; pass --resume to continue it "
                                 f"or choose another --out"}
            return None
        existing = runlog.read_manifest(out)
        if existing is None:
            return {"error": f"{out}: no manifest.json, nothing to resume"}
        if not (out / "checkpoint.pt").is_file() and existing.get("epochs_completed"):
            return {"error": f"{out}: no checkpoint.pt, though {existing['epochs_completed']} "
                             f"epoch(s) finished; delete the folder and start again"}
        if existing.get("world_size") != self.size:
            return {"error": f"{out} was run with {existing.get('world_size')} processes; "
                             f"resume it with the same number (now {self.size})"}
        if existing.get("config") != self.config:
            return {"error": f"{out} holds configuration {existing.get('config')}, not "
                             f"{self.config}; use the same flags"}
        return None

    def resume(self, model, optimizer):
        """With --resume: rank 0 reads the checkpoint (other hosts may not see the file) into
        `model`, which reaches the other ranks by the caller's broadcast_parameters(); the
        optimizer state and the position reach every rank here, and each rank restores its
        own RNG state.  Rows after the checkpoint are dropped so the unfinished epoch is
        recorded once.  A run stopped before its first epoch ended has no checkpoint: it
        starts again at epoch 1 (torch.manual_seed made the same weights, and the data order
        is the seed's), its rows dropped.  Returns the first epoch to train."""
        if not self.args.resume:
            return self.first_epoch
        position = None
        if self.rank == 0 and (self.run_dir / "checkpoint.pt").is_file():
            state = runlog.load_checkpoint(self.run_dir / "checkpoint.pt")
            model.load_state_dict(state["model"])
            position = {k: state[k] for k in ("optimizer", "epoch", "step", "torch_rng")}
            position["compression_state"] = state.get("compression_state")
        position = self.engine.broadcast_object(position, root_rank=0, name="resume_position")
        if position is None:            # from the start: only the rows go
            self.dropped = runlog.truncate_csv(self.run_dir / f"steps_rank{self.rank}.csv",
                                               lambda row: False)
            if self.rank == 0:
                runlog.truncate_csv(self.run_dir / "epochs.csv", lambda row: False)
                runlog.truncate_csv(self.run_dir / "evals.csv", lambda row: False)
            return self.first_epoch
        # Every rank loads the state, so broadcast_optimizer_state() later finds it everywhere
        # (a rank with an empty state would run an initialising step alone and hang).
        optimizer.load_state_dict(position["optimizer"])
        torch.set_rng_state(position["torch_rng"][self.rank])
        compression_state = (position["compression_state"] or [None] * self.size)[self.rank]
        if compression_state is not None and hasattr(optimizer, "load_compression_state_dict"):
            optimizer.load_compression_state_dict(compression_state)
        self.step = position["step"]
        finished = position["epoch"]
        steps_csv = self.run_dir / f"steps_rank{self.rank}.csv"
        self.dropped = runlog.truncate_csv(steps_csv, lambda row: int(row["epoch"]) <= finished)
        if steps_csv.is_file():
            self.samples = sum(int(row["samples"]) for row in runlog.read_csv_rows(steps_csv)[1])
        if self.rank == 0:
            for name in ("epochs.csv", "evals.csv"):
                runlog.truncate_csv(self.run_dir / name,
                                    lambda row: int(row["epoch"]) <= finished)
        self.first_epoch = finished + 1
        return self.first_epoch

    # ---- the whole run -----------------------------------------------------------------------

    @contextmanager
    def recording(self, optimizer, data):
        """Around the epochs: the manifest says 'running', then how the run ended; the CSV
        files are open; SIGTERM interrupts; the watchdog ends a job that stopped moving."""
        self.optimizer = optimizer
        self._fixed_stats = self._horovod_stats(optimizer)
        self.plans = manifest.plans(self.args)      # --auto-allreduce: plan columns too
        if self.plans and not (hasattr(optimizer, "plan_report")
                               and hasattr(optimizer, "pop_stats")):
            # every rank sees the same optimizer: each stops here, none waits in a collective
            raise RuntimeError("--auto-allreduce: the optimizer has no plan_report() or "
                               "pop_stats(); this hvd_compress's Compression.auto cannot say "
                               "what it chose")
        if self.rank == 0:
            started = manifest.start(self.run_dir, self.args, self.config, self.size,
                                     optimizer, data, self.first_epoch, self.dropped,
                                     self.engine.controller())
            print(f"run folder {self.run_dir}: {started['config']}, {self.size} process(es), "
                  f"{self.args.dataset} {len(data.train_y)} train / {len(data.test_y)} test, "
                  f"epochs {self.first_epoch}..{self.args.epochs}", flush=True)
        self.steps_log = runlog.CsvLog(self.run_dir / f"steps_rank{self.rank}.csv",
                                       runlog.STEP_COLUMNS
                                       + (runlog.PLAN_COLUMNS if self.plans else []))
        if self.rank == 0:
            self.epochs_log = runlog.CsvLog(self.run_dir / "epochs.csv", runlog.EPOCH_COLUMNS)
            if getattr(self.args, "holdout", None):
                self.evals_log = runlog.CsvLog(self.run_dir / "evals.csv", runlog.EVAL_COLUMNS)
        signal.signal(signal.SIGTERM, _interrupt)
        status, reason, asked = "failed", None, False
        self.watchdog = self._watchdog()
        try:
            with self.watchdog:
                yield self
                self.engine.barrier()   # every rank has flushed its last row
            status = "complete"
        except TargetReached as done:   # every rank read the same accuracy, at the same step
            status, reason = "complete", str(done)
            self.engine.barrier()       # every rank has flushed its last row
        except StepLimit as stop:       # every rank stops at the same step
            status, reason, asked = "interrupted", str(stop), True
            self.engine.barrier()       # every rank has flushed its last row
        except (Interrupted, KeyboardInterrupt) as stop:
            status, reason = "interrupted", str(stop) or type(stop).__name__
            # the launcher tears every rank down when one fails: if a fault was seen (a rank
            # stopped, a link down, silent or crawling), this run failed; it was not stopped
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            fault = self._diagnosis(deadlock=False)
            if fault:
                status, reason = "failed", f"{reason} while the job was ending after a fault: {fault}"
        except OSError as err:          # the disk (full, gone, read-only): records stop here
            reason = (f"cannot write the run's records: {err}; what was written before is "
                      f"intact, the last checkpoint included (a checkpoint is replaced only "
                      f"once its successor is fully written)")
        except Exception as err:
            reason = f"{type(err).__name__}: {err}"
            # The launcher tears the other ranks down (SIGTERM, then SIGKILL after its 5 s
            # grace: horovod's safe_shell_exec): record the failure first, so that even a
            # SIGKILL leaves no 'running' manifest, then let the teardown wait while the
            # heartbeats name the cause (at most DEAD_PEER_WAIT_S, well inside the grace).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.rank == 0:
                try:
                    runlog.update_manifest(self.run_dir, status="failed", reason=reason)
                except OSError:
                    pass                # the finally below says why it cannot write
            # a collective that failed on an emulated network: say what the links were doing,
            # once the others' heartbeats are fresh too (their watchdog threads still run)
            diagnosis = self._diagnosis(wait_s=2 * PERIOD_S)
            deadline = time.monotonic() + DEAD_PEER_WAIT_S
            while not diagnosis and time.monotonic() < deadline:
                time.sleep(0.05)
                diagnosis = self._diagnosis(deadlock=False)
            if diagnosis:
                reason += f" ({diagnosis})"
                print(f"rank {self.rank}: {diagnosis}", file=sys.stderr, flush=True)
            raise
        finally:
            try:
                self.steps_log.close()
                if self.evals_log is not None:
                    self.evals_log.close()
                if self.rank == 0:
                    manifest.finish(self.run_dir, status, reason, self._plan_report())
            except OSError as err:      # a full disk may refuse the manifest too: say so
                print(f"rank {self.rank}: could not record how the run ended in "
                      f"{self.run_dir}: {err}", file=sys.stderr, flush=True)
        if status != "complete":
            if self.rank == 0:
                how = f"continue it with --out {self.run_dir} --resume"
                if not (self.run_dir / "checkpoint.pt").is_file():
                    how += " (no epoch had ended: it starts again at epoch 1, the same run)"
                print(f"run {'stopped' if asked else status}: {reason}; {how}", flush=True)
            if not asked:
                sys.exit(3)

    def _diagnosis(self, wait_s=0.0, deadlock=True):
        """What the ranks' heartbeats say went wrong (watchdog.suspects), this rank's own first
        brought up to date on an emulated network (its link may have just died), and waiting
        wait_s there for the others' to be."""
        if self.watchdog.link_probe is not None:
            self.watchdog.heartbeat()
            time.sleep(wait_s)
        return suspects(self.run_dir / "heartbeats", self.size, exclude=self.rank,
                        deadlock=deadlock)

    def _watchdog(self):
        """A StepWatchdog (adaptive unless --step-timeout fixes it; 0: off) that writes this
        rank's heartbeat into the run folder, so the rank that stops is named, and that, before
        it ends this process, records on rank 0 that the run failed, so the manifest never
        claims 'running' for a dead job."""
        timeout = self.args.step_timeout
        watchdog = StepWatchdog(timeout or None, rank=self.rank, size=self.size,
                                heartbeat_dir=self.run_dir / "heartbeats", enabled=timeout != 0,
                                link_probe=link_probe(), ceiling_s=gloo_ceiling(),
                                floor_s=getattr(self.args, "step_timeout_floor", None) or FLOOR_S)
        end_process = watchdog.on_timeout

        def on_timeout(idle):
            try:
                if self.rank == 0:
                    manifest.finish(self.run_dir, "failed",
                                    f"watchdog: no training step or evaluation finished for "
                                    f"{idle:.0f} s ({watchdog.why}); "
                                    + (suspects(watchdog.heartbeat_dir, self.size, exclude=0)
                                       or "a rank is dead or wedged"))
            finally:
                end_process(idle)
        watchdog.on_timeout = on_timeout
        return watchdog

    # ---- one epoch ---------------------------------------------------------------------------

    def steps(self, epoch, batches, validate=None):
        """A Step per batch of this rank's shard.  Each is timed, written as a row of
        steps_rank<r>.csv with the optimizer's timings and bytes, and shown as progress;
        --max-steps interrupts here.  After the last, the epoch's totals over all ranks.
        With --holdout, `validate()` (the trainer's score of the held-out split) runs after
        the epoch's last step and, with --eval-every N, every N steps of the run, between two
        steps, outside their time; its row goes to evals.csv."""
        args = self.args
        progress = Progress(args.progress and self.rank == 0, len(batches),
                            f"epoch {epoch}/{args.epochs}")
        timer = runlog.StepTimer()
        loss_sum, samples, bytes_sent = 0.0, 0, 0.0
        self._pop_stats()               # drop anything counted before this epoch
        wire_start = self._wire()       # this rank's NIC counter (netem; NaN on loopback)
        start, self._validation_s = time.perf_counter(), 0.0
        for batch, index in enumerate(batches):
            step = Step(index, timer)
            with timer("step"):
                yield step
            self.step += 1
            self.samples += len(index)
            times, stats = timer.pop(), self._pop_stats()
            self.steps_log.write(self._step_row(epoch, batch, len(index), step.loss, times,
                                                stats))
            self.watchdog.beat()        # progress: the job is alive
            if validate is not None and self._validation_due(batch + 1 == len(batches)):
                self._validate(epoch, validate)
            loss_sum += step.loss * len(index)
            samples += len(index)
            bytes_sent += stats["bytes_sent"]
            if (batch + 1) % args.log_interval == 0 or batch + 1 == len(batches):
                progress.update(batch + 1, step.loss, force=batch + 1 == len(batches))
            if (args.max_steps is not None and self.step >= args.max_steps
                    and batch + 1 < len(batches)):
                progress.close()
                raise StepLimit(f"--max-steps {args.max_steps} reached in epoch {epoch}")
        progress.close()
        self.watchdog.begin("evaluation")   # the epoch's totals and test pass come next
        epoch_s = time.perf_counter() - start - self._validation_s    # training alone
        wire = self._wire() - wire_start
        totals = self.engine.allreduce(torch.tensor([loss_sum, samples, bytes_sent, wire],
                                                    dtype=torch.float64),
                                       f"train_totals.{epoch}", SUM)
        self._train = {"epoch": epoch, "steps": len(batches), "train_samples": int(totals[1]),
                       "train_loss": float(totals[0] / totals[1]), "epoch_s": epoch_s,
                       "train_samples_per_s": float(totals[1]) / epoch_s,
                       "bytes_sent": float(totals[2]), "wire_tx_bytes": float(totals[3])}

    def _validation_due(self, last_of_epoch):
        every = getattr(self.args, "eval_every", None)
        return last_of_epoch or bool(every) and self.step % every == 0

    def _validate(self, epoch, validate):
        """One evaluation on the held-out split, between two steps; rank 0 writes its row."""
        start = time.perf_counter()
        with self.watchdog.phase("validation"):
            metrics = validate()
        self._validation_s += time.perf_counter() - start
        if self.rank == 0:
            self.evals_log.write({"epoch": epoch, "step": self.step,
                                  "samples": self.samples * self.size, **metrics,
                                  "wall_time": time.time()})
        target = getattr(self.args, "target_accuracy", None)
        if target is not None and metrics["holdout_accuracy"] >= target:
            if self.rank == 0:
                print(f"target reached: held-out accuracy "
                      f"{100 * metrics['holdout_accuracy']:.2f}% >= {100 * target:.2f}% after "
                      f"{self.step} steps", flush=True)
            raise TargetReached(f"--target-accuracy {target:g} reached after {self.step} steps "
                                f"(epoch {epoch})")
        # as after an epoch's test: Compression.auto would read the evaluation into the next
        # step's time
        pause = getattr(self.optimizer, "pause_step_clock", None)
        if pause is not None:
            pause()

    def end_epoch(self, epoch, test_metrics, model, optimizer):
        """After an epoch's test: its row of epochs.csv and its line on rank 0, the checkpoint,
        epochs_completed in the manifest; --max-steps may end the run here."""
        self.watchdog.end("evaluation")
        record = dict(self._train, **test_metrics, wall_time=time.time())
        if self.rank == 0:
            self.epochs_log.write(record)
            print(f"epoch {epoch}: test loss {record['test_loss']:.4f}, accuracy "
                  f"{100 * record['test_accuracy']:.2f}%, {record['epoch_s']:.1f}s, "
                  f"{record['train_samples_per_s']:.0f} samples/s", flush=True)
        with self.watchdog.phase("checkpoint"):
            self._save_checkpoint(model, optimizer, epoch)
            if self.rank == 0:
                runlog.update_manifest(self.run_dir, epochs_completed=epoch,
                                       **({"plan_report": self._plan_report()}
                                          if self.plans else {}))
        # Compression.auto judges its plan on the time from one step's end to the next: the
        # next epoch's first step would count this evaluation and checkpoint as training.
        pause = getattr(optimizer, "pause_step_clock", None)   # stock Horovod's has none
        if pause is not None:
            pause()
        args = self.args
        if args.max_steps is not None and self.step >= args.max_steps and epoch < args.epochs:
            raise StepLimit(f"--max-steps {args.max_steps} reached after epoch {epoch}")

    def _save_checkpoint(self, model, optimizer, epoch):
        """Rank 0 writes model, optimizer, position and every rank's RNG state (dropout),
        atomically."""
        rng_states = self.engine.allgather_object(torch.get_rng_state(), f"rng.{epoch}")
        # Each rank's own residuals (and PowerSGD's Q): error feedback differs by rank.
        own = optimizer.compression_state_dict() if hasattr(optimizer, "compression_state_dict") else None
        compression_states = self.engine.allgather_object(own, f"compression_state.{epoch}")
        if self.rank == 0:
            runlog.save_checkpoint(self.run_dir / "checkpoint.pt", {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "step": self.step, "world_size": self.size,
                "torch_rng": rng_states, "compression_state": compression_states})

    # ---- what a step cost ---------------------------------------------------------------------

    def _horovod_stats(self, optimizer):
        """Horovod's own optimizer (--optimizer horovod, --use-adasum) works in backward hooks and
        synchronize(), out of our reach: no per-phase times (NaN), and the bytes the plugin
        counts for it (NaN for Adasum).  Fixed per step; the plugin's own are popped."""
        if hasattr(optimizer, "pop_stats") or self.args.use_adasum:
            return dict(NO_STATS)
        numels = [p.numel() for group in optimizer.param_groups for p in group["params"]
                  if p.requires_grad]
        compression = getattr(hvd.Compression, self.args.compression)
        return dict(NO_STATS, bytes_sent=horovod_bytes_sent(compression, numels, self.size))

    def _plan_report(self):
        """The optimizer's plan report (--auto-allreduce), None otherwise or if it fails now:
        how the run ended is recorded all the same."""
        try:
            return manifest.plan_report(self.optimizer, self.args)
        except Exception as err:        # the run's own error is the one to report
            print(f"rank {self.rank}: no plan report: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            return None

    def _pop_stats(self):
        """The plugin's timings and bytes since the last call, or Horovod's fixed numbers."""
        if hasattr(self.optimizer, "pop_stats"):
            return self.optimizer.pop_stats()
        return dict(self._fixed_stats)

    def _step_row(self, epoch, batch, samples, loss, times, stats):
        """One row of steps.csv; the update time is step() minus what pop_stats() accounts
        for.  The plugin compresses full buckets from gradient hooks while backward runs: that
        part (in_backward_s) moves from forward+backward to compress, so the columns add up."""
        in_backward = stats.get("in_backward_s", 0.0)
        in_step = (stats["copy_s"] + stats["compress_s"] + stats["communicate_s"]
                   + stats["decompress_s"] - in_backward)
        row = {"rank": self.rank, "epoch": epoch, "step": self.step, "batch": batch,
               "samples": samples, "loss": loss, "step_s": times["step"],
               "forward_backward_s": times["forward_backward"] - in_backward,
               "copy_s": stats["copy_s"],
               "compress_s": stats["compress_s"], "communicate_s": stats["communicate_s"],
               "decompress_s": stats["decompress_s"],
               "update_s": times["optimizer"] - in_step if math.isfinite(in_step)
               else times["optimizer"],
               "bytes_sent": stats["bytes_sent"],
               "exchange_s": stats.get("exchange_s", math.nan),
               "launch_span_s": stats.get("launch_span_s", math.nan), "wall_time": time.time()}
        if self.plans:
            row.update(plan_columns(stats))
        return row


def plan_columns(stats):
    """The PLAN_COLUMNS of a step from pop_stats() of an optimizer that plans per bucket; a
    missing key is an error (a blank would read as 'no plan yet')."""
    missing = [k for k in ("plan", "plan_predicted_s", "plan_measured_s", "plan_event")
               if k not in stats]
    if missing:
        raise RuntimeError(f"--auto-allreduce: pop_stats() has no {', '.join(missing)}; this "
                           f"hvd_compress's Compression.auto does not report its plan")
    return {"plan": stats["plan"], "plan_predicted_ms": 1000 * stats["plan_predicted_s"],
            "plan_measured_ms": 1000 * stats["plan_measured_s"],
            "plan_event": stats["plan_event"]}


def _interrupt(signum, frame):
    raise Interrupted(f"signal {signal.Signals(signum).name}")
