"""Alpha-beta communication cost model of Horovod's collectives and hvd-compress's schemes.

    from hvd_compress.costmodel import Link, predict, parse_size, parse_rate, parse_time
    link = Link.from_bandwidth(parse_time("1ms"), parse_rate("10Gbit/s"))
    predict("allgather", n=8, g=parse_size("32MiB"), bits=8).seconds(link)

Command line: hvd-compress-costmodel --help (python -m hvd_compress.costmodel; formulas:
docs/costmodel.md)
Pure Python + NumPy: importing this does not import torch or Horovod.
"""
from .model import (  # noqa: F401
    EXCHANGES, REFERENCE, Cost, Link, allgather, allgather_crossover, alltoall,
    bandwidth_crossover, broadcast_tree, compressed_allgather, compressed_two_phase,
    course_allreduce_time, double_binary_tree_allreduce, first_n_not_faster, lumped_latency,
    parameter_server, predict, predict_table, reduce_scatter, ring_allreduce, tree_allreduce,
    wire_bytes,
)
from .units import (  # noqa: F401
    UnitError, format_rate, format_size, format_time, parse_rate, parse_size, parse_time,
)
