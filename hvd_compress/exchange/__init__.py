"""The exchange: which gradients travel together, by which collective, and what they cost.

    bucketing.py   bucket membership and the two-phase route's chunks (pure: the cost model
                   reads it too)
    fusion.py      Bucket: a flat float32 buffer whose views are the gradients
    base.py        an exchange in flight, the wait that does not spin, the counters, the frame
                   of start/advance/finish every communicator shares (CommunicatorBase)
    routes.py      the communicators of the routes (allreduce, allgather, two-phase) and
                   make_communicator, which picks one for a scheme
    memory.py      error feedback: what a lossy scheme drops waits for the next step

Nothing is imported here, so the pure bucketing can be read without torch or Horovod.
"""
