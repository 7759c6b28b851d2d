"""The front core: what every front door (the Horovod optimizer, the DDP hook, the next one)
shares, so that each front keeps only its engine's life cycle.

    core.py     FrontCore: the compression resolved, the communicator made (make_communicator),
                error feedback keyed by parameter name, the ranks' agreement through the engine,
                one checkpoint format, write-back, the end of a step

docs/architecture.md ("A front and its core") says what a front must do and what the core
gives it.
"""
