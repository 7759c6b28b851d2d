"""hvd-compress: 8-bit and 16-bit gradient compression for Horovod (PyTorch).

    import horovod.torch as hvd
    import hvd_compress as hc

    hvd.init()
    opt = hc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=hc.Compression.bit8)

The layers, one folder each (codecs, compressors, exchange, methods, auto, costmodel; registry,
roles, compression and optimizer at the top), one bucket's hot path and Compression.auto's
loop: docs/architecture.md. A new scheme is one file: docs/extending.md. Names are loaded
lazily, so `hvd_compress.codecs` and `hvd_compress.ddp` work without Horovod (what needs it
raises HorovodMissing, saying how to get it), and Horovod's own (patched) source can
import `hvd_compress.compressors` without a circular import.
"""
import importlib

__version__ = "0.1.0"
__all__ = ["Compression", "Bit8Compressor", "Bit16Compressor", "DistributedOptimizer",
           "make_communicator", "Route", "SCHEMES", "HorovodMissing"]

_WHERE = {"Compression": "compression", "Bit8Compressor": "compressors",
          "Bit16Compressor": "compressors", "DistributedOptimizer": "optimizer",
          "make_communicator": "exchange.routes", "Route": "registry", "SCHEMES": "registry",
          "HorovodMissing": "engine.base"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
