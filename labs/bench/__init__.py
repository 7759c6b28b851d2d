"""The benchmarks of the lab room, as a package (they move here from scripts/); they use the
lab kit (labs/kit: the trainers' records, the time-to-accuracy measure, tta.py), never the
other way round.

    tta_grid.py   the grid: every method's steps to each target (2 and 4 ranks, both lab
                  networks, several seeds), the step-time cells, and the time to each target
                  on every link (`python -m labs.bench.tta_grid`)
    tta_check.py  the composition against runs made directly on an emulated link
    shadow_probe.py  the lossy methods' shadow progress along float32's trajectory (what
                  Compression.auto's choice by time to accuracy reads), one process
"""
