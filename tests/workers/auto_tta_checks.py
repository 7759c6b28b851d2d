"""Run under horovodrun (tests/workers/suite.py): Compression.auto(objective="time_to_accuracy")
on real ranks (hvd_compress/auto/objective.py). The link is emulated by step times injected
through the documented `step_s=` option (a slow value plan, cheap lossy methods), so what
decides is the job's own measure of each method's progress, taken from its real gradients
and averaged gradients over Horovod:

- every rank decides alike (the same windows, ratios, modes, switches; the same weights);
- where a lossy method clearly pays it is switched to after the first (critical) interval;
- top-k 0.1%, the cheapest step of all, is refused by the accuracy guard (r < r_min);
- a jump of the gradient's norm (the loss scaled up mid-run) is a critical interval: back to
  the value codecs, at the same step everywhere;
- a job stopped and resumed from its checkpoint (model, optimizer, compression state) ends
  with the bits of the job that never stopped, the value plan pinned (plan=), the switches
  alike.
"""
import io

import torch

import hvd_compress as hc
from hvd_compress.auto import convergence
import checks

FUSION = 64 << 10
INTERVAL = 10
# The emulated link: the value plan's step is slow, every lossy method's cheap; top-k 0.1%
# the cheapest of all (the accuracy guard must refuse it all the same).
METHODS = ("int8", "powersgd4", "topk0.1", "topk0.001")
STEP_S = {"value": 1.0, "int8": 0.05, "powersgd4": 0.04, "topk0.1": 0.04, "topk0.001": 0.001}
SCALE_AT = 35            # the loss is scaled by SCALE from this step on: a regime change
SCALE = 8.0
STEPS = 60


def net():
    torch.manual_seed(0)
    # large enough that top-k 0.1% keeps a thousandth of each matrix (a tiny layer's k = 1
    # would be a large share of it)
    return torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def data(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 100, generator=gen)
    return x, x[:, :4] * 0.5 + 0.1 * torch.randn(16, 4, generator=gen)


def optimizer(model, **options):
    auto = hc.Compression.auto(warmup_steps=5, trial_steps=0, objective="time_to_accuracy",
                               methods=METHODS, step_s=STEP_S, interval=INTERVAL, **options)
    return hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=auto,
                                   fusion_threshold_bytes=FUSION)


def train(rank, model, opt, first, last):
    for step in range(first, last):
        x, y = data(rank, step)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        (loss * (SCALE if step >= SCALE_AT else 1.0)).backward()
        opt.step()
        opt.pop_stats()


def report(opt):
    return opt.plan_report().to_dict()["objective"]


def run(hvd):
    rank = hvd.rank()
    model = net()
    opt = optimizer(model)
    train(rank, model, opt, 0, STEPS)
    objective = report(opt)
    every = hvd.allgather_object(objective)
    checks.check("tta.same_decisions_on_every_rank", all(o == every[0] for o in every),
                 str([o["switches"] for o in every]))
    checks.check("tta.identical_weights", checks.same_everywhere(list(model.parameters())))
    windows, switches = objective["windows"], objective["switches"]
    checks.check("tta.first_interval_critical", windows and windows[0]["critical"]
                 and windows[0]["next"] == "value", str(windows[:1]))
    # where a lossy method pays: the first non-critical window switches to one, and to the
    # one convergence.choose gives from the window's own numbers
    calm = [w for w in windows if not w["critical"]]
    checks.check("tta.a_calm_window_before_the_change", calm and calm[0]["step"] < SCALE_AT,
                 str([(w["step"], w["critical"], w["norm"]) for w in windows]))
    first = calm[0]
    chosen = convergence.choose(first["step_s"], first["pooled"], first["mode"])
    checks.check("tta.switches_to_a_lossy_method_that_pays",
                 first["next"] != "value" and first["next"] == chosen and
                 first["pooled"][chosen] >= convergence.R_MIN, str(first))
    checks.check("tta.switch_recorded_at_the_window", [first["step"], "value", chosen]
                 == switches[0][:3], str(switches))
    # the accuracy guard: top-k 0.1% is the cheapest step and is never taken
    checks.check("tta.guard_refuses_topk_0.1_percent",
                 all(w["next"] != "topk0.001" for w in windows) and
                 all(w["ratios"].get("topk0.001", 0.0) < convergence.R_MIN for w in windows
                     if w["ratios"]), str([w["ratios"].get("topk0.001") for w in windows]))
    # the regime change: the window that ends after the loss was scaled is critical, and
    # the mode goes back to the value codecs
    after = [w for w in windows if w["step"] > SCALE_AT]
    checks.check("tta.regime_change_is_critical", after and after[0]["critical"],
                 str([(w["step"], w["critical"], w["norm"]) for w in windows]))
    back = [s for s in switches if s[0] == after[0]["step"]]
    checks.check("tta.regime_change_switches_back_to_value",
                 back and back[0][2] == "value" and "critical" in back[0][3], str(switches))
    resume(hvd, opt)
    probe(hvd)


def probe(hvd):
    """A candidate without an injected step is probed once a calm window allows it: a few
    steps of it, timed, averaged over the ranks, alike everywhere, then the mode it left."""
    rank = hvd.rank()
    model = net()
    auto = hc.Compression.auto(warmup_steps=5, trial_steps=0, objective="time_to_accuracy",
                               methods=("int8",), step_s={"value": 1.0}, interval=INTERVAL)
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                  named_parameters=model.named_parameters(), compression=auto,
                                  fusion_threshold_bytes=FUSION)
    train(rank, model, opt, 0, 3 * INTERVAL)
    made = report(opt)
    every = hvd.allgather_object(made)
    checks.check("tta.probe.same_on_every_rank", all(o == every[0] for o in every))
    whys = [s[3] for s in made["switches"]]
    checks.check("tta.probe.ran_and_came_back", any(w.startswith("probe: int8") for w in whys)
                 and "probe done" in whys, str(made["switches"]))
    t = made["step_s"].get("int8")
    checks.check("tta.probe.step_measured", t is not None and 0 < t < 1.0, str(made["step_s"]))


def resume(hvd, live):
    """The value plan pinned (float32 on each of the job's buckets, as the live job's report
    names them): a job stopped between two windows (a lossy method in force) and resumed from
    its checkpoint ends with the uninterrupted job's bits and switches."""
    rank = hvd.rank()
    layout = [(b["name"], b["bytes"], "none:allreduce")
              for b in live.plan_report().to_dict()["buckets"]]
    save_at, last = 27, SCALE_AT + 10          # saved with powersgd4 in force, ended past the change
    whole = net()
    opt = optimizer(whole, plan=layout)
    train(rank, whole, opt, 0, last)
    first = net()
    opt1 = optimizer(first, plan=layout)
    train(rank, first, opt1, 0, save_at)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict(),
                "compression": opt1.compression_state_dict()}, buffer)
    mode_at_save = report(opt1)["mode"]
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    second = net()
    second.load_state_dict(saved["model"])
    opt2 = optimizer(second, plan=layout)
    opt2.load_state_dict(saved["opt"])
    opt2.load_compression_state_dict(saved["compression"])
    train(rank, second, opt2, save_at, last)
    checks.check("tta.resume.saved_in_a_lossy_mode", mode_at_save != "value", mode_at_save)
    checks.check("tta.resume.equals_uninterrupted", all(
        torch.equal(a, b) for a, b in zip(whole.parameters(), second.parameters())))
    checks.check("tta.resume.same_switches", report(opt)["switches"] == report(opt2)["switches"],
                 f"{report(opt)['switches']} against {report(opt2)['switches']}")
    checks.check("tta.resume.pinned_plan_in_force",
                 opt2.plan_report().calibrations == 0 and
                 opt2.plan_report().labels == [t for _, _, t in layout])
