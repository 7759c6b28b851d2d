"""The network emulator: a small cluster on one machine, one network namespace per rank.

Why: on one machine Horovod ranks talk over loopback, tens of Gbit/s with no latency worth the
name, so every compression scheme "wins" or "loses" for reasons no real cluster shares. Here
each rank gets its own network stack and a NIC of a chosen rate and delay (docs/netem.md).

    links.py     LinkShape: rate, delay, MTU of every rank's NIC; the tbf qdisc (pure)
    topology.py  names, addresses and the ip/tc commands of one cluster (pure)
    cluster.py   Cluster: build the namespaces, always remove them; capabilities; cleanup
    launch.py    run_ranks: Horovod ranks in the namespaces (Gloo rendezvous, or mpirun)
    bridge.py    the userspace delay switch, for kernels without sch_netem
    cli.py       `python -m labs.netem run|bench|check|cleanup|commands`
    bench.py     the collectives benchmark (`python -m labs.netem.bench`); plots.py its plot
    faults.py    a running cluster's link down or up, packet loss, a crawl (`... fault`)

As a library (root)::

    from labs.netem import Cluster, LinkShape, run_ranks
    with Cluster(n=2, link=LinkShape.parse("1gbit", "0")) as cluster:
        result = run_ranks(cluster, ["python", "train.py"], timeout=120)
"""
from .cluster import (NETNS_ETC, Capabilities, Cluster, cleanup, delete_namespace,  # noqa: F401
                      list_namespaces, probe_capabilities)
from .launch import RunResult, mpirun_command, rank_env, run_ranks, wire_counter  # noqa: F401
from .links import (DELAY_VIA, LinkShape, NetemError, parse_duration, parse_rate,  # noqa: F401
                    tbf_args)
from .topology import (HOST_PORT, Topology, hosts_file, setup_commands,  # noqa: F401
                       shaping_commands)
