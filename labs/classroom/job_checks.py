"""Checks read from the Horovod jobs' records: the trainer (step 1) and the exchange (step 3a).

What the grader observes itself, outside the kit's processes: how every rank's process ended
(the fork server), the bytes the ranks sent each other (the fork server's count of the
sandbox's loopback), the accuracy of rank 0's final weights, loaded into the grader's own copy
of the course's network and scored on test labels no sandbox holds (course_net), and the logs
kitlog wrote (read as data, schema.read_log). What the student side observes inside the kit's
processes, where a kit that tampers with it spoils only its own row: the model's weights
before its first training step and after its last, on every rank (digests), and the samples
each rank trained on (a forward hook).
"""
import math
from pathlib import Path

from . import schema
from .checks import fail, ok
from .course_net import PARAMETERS


def _job_failure(step, name, records, np):
    """A failure when some rank left no record (the job died, hung or was stopped), else None.
    records[None] says how the job ended, in words that hold no timing (the sheet of a class
    is the same whatever the load)."""
    if len([r for r in records if r is not None]) >= np:
        return None
    how, unreadable = records.get(None, ("ended early", ""))
    if unreadable:
        return fail(step, name, f"the job on {np} processes {how}.",
                    f"{np} 个进程的作业写出了评分器无法读取的结果（{how}）。")
    return fail(step, name, f"the job on {np} processes {how} before every rank finished.",
                f"{np} 个进程的作业在所有进程完成之前结束（{how}）。")


def log_check(name, log_dir, np):
    """kitlog's files: every rank's steps with times, rank 0's evaluations with accuracy, each
    row of the form kitlog writes (schema.read_log)."""
    log_dir = Path(log_dir)
    try:
        for r in range(np):
            path = log_dir / f"steps-rank{r}.csv"
            rows = schema.read_log(path, "steps")
            if rows is None:
                return fail("trainer", name, f"no {path.name} in {log_dir}: every rank logs every step "
                            f"with kitlog.TrainLog(args.log_dir).step(epoch, step, seconds, loss) "
                            f"(after hvd.init(), so that the file carries the rank).",
                            f"{log_dir} 中没有 {path.name}：每个进程都要在 hvd.init() 之后用 "
                            f"kitlog.TrainLog(args.log_dir).step(...) 记录每一步。")
            if not rows or not all(row["seconds"] > 0 for row in rows):
                return fail("trainer", name, f"{path.name}: no steps, or a step time that is not > 0.",
                            f"{path.name}：没有步记录，或步时间不大于 0。")
            if rows[0]["size"] != np:
                return fail("trainer", name, f"{path.name} says {rows[0]['size']} process(es), the job "
                            f"had {np}: call hvd.init() before kitlog.TrainLog.",
                            f"{path.name} 记录的进程数为 {rows[0]['size']}，实际为 {np}：请在 "
                            f"kitlog.TrainLog 之前调用 hvd.init()。")
        epochs = log_dir / "epochs-rank0.csv"
        if not schema.read_log(epochs, "epochs"):
            return fail("trainer", name, f"no evaluations in {epochs}: log each epoch's test loss and "
                        f"accuracy with log.epoch(epoch, test_loss, test_accuracy).",
                        f"{epochs} 中没有评估记录：每个 epoch 用 log.epoch(...) 记录测试损失和正确率。")
    except schema.Malformed as err:
        return fail("trainer", name, f"{err}: not a log kitlog writes; log with kitlog.TrainLog "
                    f"(log.step(epoch, step, seconds, loss), log.epoch(epoch, test_loss, "
                    f"test_accuracy)), never by hand.",
                    f"{err}：不是 kitlog 写出的日志；请用 kitlog.TrainLog 记录，不要手写。")
    return ok("trainer", name)


TRAINER_CHECKS = ("runs", "logs", "shard", "broadcast", "average", "accuracy")


def _network_failure(run0):
    """Why rank 0's run gave the grader nothing to score (None: its weights are the course's
    network's, loaded), from the judged record (grade.job_records)."""
    if run0.get("network_error"):
        return (f"rank 0's model is not the course's network: {run0['network_error']}. The "
                f"grader scores the weights of train.py's Net itself: keep its layers.",
                f"进程 0 的模型不是课程的网络：{run0['network_error']}。评分器自己对 train.py 中 Net "
                f"的权重评分：请保留它的各层。")
    if run0.get("start") is not None and run0.get("start") == run0.get("end"):
        return ("rank 0's model ended with the weights it started from: train.py must train it "
                "(optimizer.step() after each backward).",
                "进程 0 的模型训练结束时的权重与开始时相同：train.py 必须训练它（每次 backward 后 "
                "optimizer.step()）。")
    return None


def trainer_checks(records, np, log_dir, train_samples, epochs, min_accuracy, test_samples,
                   sent=None):
    """Six checks of one kit's trainer on `np` processes. sent: the bytes the job's ranks sent
    each other (the fork server's count), None when not counted."""
    prefix = f"trainer.np{np}"
    names = list(TRAINER_CHECKS)
    broken = _job_failure("trainer", f"{prefix}.runs", records, np)
    if broken is None:
        errors = [(r, rec["trainer"]["error"]) for r, rec in sorted(records.items(), key=str)
                  if r is not None and rec.get("trainer", {}).get("error")]
        if errors:
            broken = fail("trainer", f"{prefix}.runs", f"train.py failed on rank {errors[0][0]}: "
                          f"{errors[0][1]}.", f"train.py 在进程 {errors[0][0]} 上失败：{errors[0][1]}。")
        elif (why := _network_failure(records[0]["trainer"])) is not None:
            broken = fail("trainer", f"{prefix}.runs", *why)
    if broken is not None:
        return [broken] + [fail("trainer", f"{prefix}.{n}", "not checked: the trainer did not run "
                                "to the end (see runs).", "未检查：训练没有运行完成（见 runs）。")
                           for n in names[1:]]
    runs = [records[r]["trainer"] for r in range(np)]
    results = [ok("trainer", f"{prefix}.runs"), log_check(f"{prefix}.logs", log_dir, np)]

    share = math.ceil(train_samples / np) * epochs
    worst = max(range(np), key=lambda r: runs[r]["train_samples"])
    seen = runs[worst]["train_samples"]
    if seen == 0:
        results.append(fail("trainer", f"{prefix}.shard", "the model never ran in training mode.",
                            "模型从未在训练模式下运行。"))
    elif seen > 1.1 * share:
        results.append(fail("trainer", f"{prefix}.shard",
                            f"rank {worst} trained on {seen} samples in {epochs} epoch(s) of "
                            f"{train_samples} on {np} processes, not its 1/{np} share ({share}): "
                            f"every rank read the whole data set. Give each rank its own shard: "
                            f"DataLoader(..., sampler=DistributedSampler(dataset, "
                            f"num_replicas=hvd.size(), rank=hvd.rank())) and "
                            f"sampler.set_epoch(epoch).",
                            f"进程 {worst} 在 {np} 个进程下训练了 {seen} 个样本，而不是它的 1/{np} 份"
                            f"（{share}）：每个进程都读了全部数据。请用 DistributedSampler"
                            f"（num_replicas=hvd.size(), rank=hvd.rank()）给每个进程分片，并每个 "
                            f"epoch 调用 set_epoch。"))
    else:
        results.append(ok("trainer", f"{prefix}.shard"))

    same_start = len({run.get("start") for run in runs}) == 1
    if same_start:
        results.append(ok("trainer", f"{prefix}.broadcast"))
    else:
        results.append(fail("trainer", f"{prefix}.broadcast",
                            "the ranks started training from different weights (the grader seeds "
                            "every rank differently, as separate machines would be): call "
                            "hvd.broadcast_parameters(model.state_dict(), root_rank=0) (and "
                            "hvd.broadcast_optimizer_state) before the first step.",
                            "各进程从不同的初始权重开始训练（评分器给每个进程不同的随机种子，如同不同"
                            "机器）：请在第一步之前调用 hvd.broadcast_parameters(model.state_dict(), "
                            "root_rank=0)（及 hvd.broadcast_optimizer_state）。"))
    if not same_start:
        results.append(fail("trainer", f"{prefix}.average", "not checked: the ranks started from "
                            "different weights (fix broadcast first).",
                            "未检查：各进程初始权重不同（先修正 broadcast）。"))
    elif (short := _too_few_bytes(runs[0], np, sent)) is not None:
        results.append(fail("trainer", f"{prefix}.average", *short))
    elif len({run.get("end") for run in runs}) != 1:
        results.append(fail("trainer", f"{prefix}.average",
                            "the ranks started alike but ended training with different weights: "
                            "their gradients were not averaged. Wrap the optimizer: "
                            "hvd.DistributedOptimizer(optimizer, named_parameters=...).",
                            "各进程初始权重相同、训练结束时却不同：梯度没有被平均。请用 "
                            "hvd.DistributedOptimizer(optimizer, named_parameters=...) 包装优化器。"))
    else:
        results.append(ok("trainer", f"{prefix}.average"))

    accuracy = runs[0].get("accuracy")
    if accuracy is None or accuracy < min_accuracy:
        shown = "no model" if accuracy is None else f"{100 * accuracy:.1f}%"
        results.append(fail("trainer", f"{prefix}.accuracy",
                            f"rank 0's model scored {shown} on the first {test_samples} test "
                            f"images, below the {100 * min_accuracy:.0f}% documented for this run "
                            f"({epochs} epoch(s) of {train_samples} images): check lr x "
                            f"hvd.size(), the loss, the averaging.",
                            f"进程 0 的模型在前 {test_samples} 张测试图上正确率 {shown}，低于此运行规定的 "
                            f"{100 * min_accuracy:.0f}%：请检查 lr x hvd.size()、损失函数与梯度平均。",
                            accuracy=accuracy, steps=runs[0]["train_steps"]))
    else:
        results.append(ok("trainer", f"{prefix}.accuracy", accuracy=accuracy, steps=runs[0]["train_steps"]))
    return results


def _too_few_bytes(run0, np, sent):
    """Why the bytes the ranks sent cannot have averaged the gradients (None: they can). Any
    averaging of the course's network's gradients, float32 or compressed, sends each step at
    least one byte per parameter to each other rank; steps: rank 0's training steps."""
    floor = run0.get("train_steps", 0) * (np - 1) * PARAMETERS
    if sent is None or sent >= floor:
        return None
    return (f"the ranks sent each other {sent:,} bytes in all, where averaging the gradients of "
            f"the course's network ({PARAMETERS:,} parameters) over {run0['train_steps']} training "
            f"steps sends at least {floor:,} (one byte per parameter per step to each other "
            f"rank): the gradients were not averaged through Horovod. Wrap the optimizer: "
            f"hvd.DistributedOptimizer(optimizer, named_parameters=...).",
            f"各进程之间一共只发送了 {sent:,} 字节，而在 {run0['train_steps']} 步训练中平均课程网络"
            f"（{PARAMETERS:,} 个参数）的梯度至少要发送 {floor:,} 字节：梯度没有通过 Horovod 平均。"
            f"请用 hvd.DistributedOptimizer(optimizer, named_parameters=...) 包装优化器。")


def exchange_checks(records, np=2, wire=None):
    """compression.allreduce on `np` ranks, both compressors, against the average of every
    rank's decoded packet, the same on every rank; then the bytes it sent (wire: {compressor:
    (en, zh) of a wire failure, or None}: grade.wire_failure)."""
    names = ["Bit8Compressor", "Bit16Compressor"]
    broken = _job_failure("exchange", "exchange.Bit8Compressor", records, np)
    if broken is not None:
        return [broken, fail("exchange", "exchange.Bit16Compressor", broken.en, broken.zh)]
    results = []
    for name in names:
        check = f"exchange.{name}"
        per_rank = [records[r]["exchange"] for r in range(np)]
        if "import_error" in per_rank[0]:
            results.append(fail("exchange", check, f"compression.py does not import: "
                                f"{per_rank[0]['import_error']}.",
                                f"compression.py 无法导入：{per_rank[0]['import_error']}。"))
            continue
        bad = [(r, rec[name]) for r, rec in enumerate(per_rank) if not rec[name]["ok"]]
        if not bad and (wire or {}).get(name):
            results.append(fail("exchange", check, *wire[name]))
            continue
        if not bad:
            results.append(ok("exchange", check))
            continue
        r, rec = bad[0]
        hint_en = ("allgather every rank's packet, decompress each, sum the float32 values in "
                   "rank order and divide by hvd.size(): average the decoded values, never the "
                   "codes")
        hint_zh = "allgather 所有进程的数据包，逐个解码，按进程顺序以 float32 求和再除以 hvd.size()：平均解码后的值，而不是编码"
        if rec.get("error"):
            results.append(fail("exchange", check, f"compression.allreduce({name}) on rank {r} "
                                f"raised {rec['error']}. Expected: {hint_en}.",
                                f"进程 {r} 上 compression.allreduce({name}) 抛出 {rec['error']}。"
                                f"应当：{hint_zh}。"))
        else:
            results.append(fail("exchange", check,
                                f"compression.allreduce({name}) on rank {r} gave {rec['got']!r} for "
                                f"value 0 where the average of the decoded packets is "
                                f"{rec['want']!r} (largest difference {rec['max_error']:.3g}"
                                f"{'' if rec['same_on_every_rank'] else '; and the ranks disagree'}). "
                                f"Expected: {hint_en}.",
                                f"进程 {r} 上 compression.allreduce({name}) 第 0 个值为 {rec['got']!r}，"
                                f"解码后平均应为 {rec['want']!r}（最大差 {rec['max_error']:.3g}）。"
                                f"应当：{hint_zh}。"))
    return results
