"""The engine: the collectives the communicators use, behind one small interface, so that the
codecs, compressors, routes, error feedback, cost model and planner serve any engine.

    base.py      Engine: what a communicator may ask (allreduce, allgather, alltoall, objects,
                 asynchronous handles, poll and wait), the ops, the wait that does not spin
    horovod.py   HorovodEngine: Horovod's collectives, exactly as the plugin called them
    distributed.py  TorchEngine: a torch.distributed ProcessGroup (Gloo on CPU, NCCL on CUDA)

`horovod_engine()` is the default every communicator takes; hvd_compress.ddp builds a
TorchEngine for its hook. Nothing is imported here, so neither Horovod nor torch.distributed
is loaded until an engine is made.
"""
