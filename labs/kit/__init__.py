"""The lab kit: what the course's trainer (labs/mnist.py) needs besides the model and the loop.

    data      MNIST / Fashion-MNIST IDX files: find, md5-check, read, shard across ranks
    table     the course's table of runs and their names (hvd_compress.registry's vocabulary)
    flags     the trainer's flag checks that argparse cannot make
    ranks     before training: Horovod's fail-fast settings, errors every rank agrees on
    recorder  a run's folder, records, checkpoints, --resume and watchdog, behind a few calls
    runlog    the files a run writes: atomic JSON/CSV, manifest, checkpoints, environment
    progress  the progress line of rank 0
    watchdog  ends a job whose ranks stopped making progress
    launch    the horovodrun command line for this kind of machine
    matrix    runs the table (python -m labs.kit.matrix), summary.csv
    report    fills report_template.md from a matrix (python -m labs.kit.report)
    plots     PNG plots of a matrix (python -m labs.kit.plots)
    tta       time to accuracy: a run's steps to a target, composed with a link's step time

The plugin (hvd_compress) imports nothing from here; the kit imports the plugin.
"""
