"""Compression.auto: the job measures itself and chooses each bucket's scheme and route.

    settings.py      Auto, the method's settings (what Compression.auto(...) returns); it
                     declares its communicator, as top-k and PowerSGD do
    records.py       what it decides and shows: measurements, decision, trial, plan report
    calibration.py   what the job measures in its first steps: links, backward's pace, codecs
    inputs.py        the planner's inputs as the job saw them, and their record (plan_report)
    planner.py       the planner's entry: the plan with the smallest predicted step, composed of
      measurements.py  what a plan is chosen from: buckets, codec costs, links, errors
      candidates.py    the candidates, their tie order, the accuracy guard
      options.py       one bucket on one candidate: its codec, wire and CPU seconds
      timeline.py      a plan's step, event by event, and the fold the search runs on
      search.py        the searches: every plan, or a Pareto-front DP the timeline improves
      replan.py        when a job re-plans: the measured steps against the prediction
    trial.py         the plan timed against its strongest rivals in the job (off by default)
    communicator.py  AutoCommunicator: measure, plan, exchange by the plan, re-plan on drift
    cli.py           `hvd-compress-plan`: ask before training, or why a job took its plan
    defaults/        the command's default inputs, committed measurements (defaults/README.md)

Nothing here is imported until asked: the planner and the CLI run without torch or Horovod.
"""
