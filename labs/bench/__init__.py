"""The benchmarks of the lab room, as a package: each runs as `python -m labs.bench.<name>`.
They use the lab kit (labs/kit: the trainers' records, the time-to-accuracy measure, tta.py), the
trainers and the emulator, never the other way round.

    rounds.py     what the step benchmarks share: the statistics of interleaved rounds (medians,
                  their distribution-free intervals, ratios taken round by round), timing two
                  things in turn, and the grid's command line
    step.py       the training step, stock hvd.DistributedOptimizer against ours, per (model,
                  link, ranks) cell, every row in the same job
    ddp.py        the same grid on PyTorch DDP: DDP's own hooks against hvd_compress.ddp's
    wins_losses.py  wins and losses of a step grid's summary, cell by cell
    ddp_targets.py  the DDP grid's step-time targets, read from its steps.csv
    codec.py      codec speed in one process: memcpy, torch's casts, our codecs
    wait.py       stock Horovod against ours on the lab net with the wait between polls swapped
    tta_grid.py   the grid: every method's steps to each target (2 and 4 ranks, both lab
                  networks, several seeds), the step-time cells, and the time to each target
                  on every link
    tta_check.py  the composition against runs made directly on an emulated link
    shadow_probe.py  the lossy methods' shadow progress along float32's trajectory (what
                  Compression.auto's choice by time to accuracy reads), one process

The collectives benchmark is labs.netem.bench (beside the emulator it drives). One-off probes
live beside the data they produced, under results/<topic>/.
"""
