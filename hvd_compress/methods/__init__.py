"""Methods that are not a codec of values: each sends every gradient on its own, by a
communicator of its own.

    tensorwise.py   the frame they share (per-tensor exchanges, residuals)
    topk.py         the k largest |g| of each gradient as (index, value) pairs, by allgather
    powersgd.py     a low-rank approximation of each matrix by two float32 allreduces
"""
