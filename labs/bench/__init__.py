"""The benchmarks of the lab room, as a package (they move here from scripts/).

    tta.py        time to accuracy: the steps a run takes to a target accuracy (held-out split),
                  composed with the step time of any link, and a run's own time to the target
    tta_grid.py   the grid: every method's steps to each target (2 and 4 ranks, both lab
                  networks, several seeds), the step-time cells, and the time to each target
                  on every link (`python -m labs.bench.tta_grid`)
"""
