"""A userspace Ethernet switch that holds every frame back for a fixed time.

Why: netem's ``delay`` needs the kernel's sch_netem, and the kernel of this project's machines
is built without it (no other qdisc can hold a packet back for a set time).  So, when asked for
a delay there, ``labs.netem`` leaves the switch namespace's veth ports out of the kernel bridge and
runs this program in that namespace instead: it reads each frame arriving on a port (an
``AF_PACKET`` socket), learns which MAC address lives behind which port, and sends the frame
out of the destination port ``--delay`` seconds later.  Rank-to-rank one-way latency grows by
the delay, the round trip by twice the delay, as with ``netem delay`` on each rank's NIC.

Rate limiting stays in the kernel (the tbf qdiscs on both ends of every veth), so the frames
this program sends still wait for the token bucket of the port they leave by.

Speed: TCP hands the veths segments of up to 64 KiB (GSO); the sockets ask for the virtio-net
header (``PACKET_VNET_HDR``), so such a frame is read and sent whole, with its offload
metadata, rather than as 45 frames of 1500 bytes.  At 1 Gbit/s per rank that is a few thousand
frames a second, which a Python loop keeps up with (docs/netem.md).  Frames leave in arrival
order (the delay is the same for all) from one FIFO queue, woken by ``select``, so a frame
leaves a little later than asked, more so when the cores are busy (``late_max_s`` counts it).
Frames that would push the bytes held over ``--max-queue`` are dropped and counted, like a
full netem queue.

Loss (the kernel has no netem ``loss`` either, nor tc's classifier and action modules): with
``--loss-file PATH`` each arriving frame is dropped with the probability written in that file
(a number in [0, 1], read again whenever it changes, at most every LOSS_POLL_S); ``python -m
labs.netem fault loss P`` writes it. A frame may be a 64 KiB GSO segment, so a loss is a burst
of up to 45 packets, as when a switch drops a burst.

Usage (inside the switch namespace, as root)::

    python -m labs.netem.bridge --delay 0.5ms p0 p1 p2 host

It prints ``ready`` on stdout once every port is open, and on SIGTERM/SIGINT a JSON line of
counters on stdout, then exits 0.
"""
from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import random
import select
import signal
import socket
import sys
import time

from hvd_compress.costmodel.units import parse_time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR_LEN = 10            # struct virtio_net_hdr
FRAME_MAX = VNET_HDR_LEN + 14 + 65536 + 64
BROADCAST_BIT = 0x01         # the I/G bit of the first destination byte: multicast/broadcast
LOSS_POLL_S = 0.25           # how often --loss-file is looked at


def parse_seconds(text: str) -> float:
    """'0.5ms', '100us', '0.001' (seconds) -> seconds (hvd_compress.costmodel.units)."""
    return parse_time(text, default_unit="s")


def open_port(ifname: str, bufsize: int = 4 << 20) -> socket.socket:
    """A raw packet socket on `ifname` that sees only frames arriving there, with GSO headers."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
    sock.bind((ifname, ETH_P_ALL))
    sock.setblocking(False)
    return sock


class DelaySwitch:
    """Learning switch over packet sockets; every frame leaves `delay` seconds after it came."""

    def __init__(self, ports: list[str], delay: float, max_queue: int, loss_file=None):
        self.names = list(ports)
        self.socks = [open_port(name) for name in ports]
        self.index = {sock.fileno(): i for i, sock in enumerate(self.socks)}
        self.delay = delay
        self.max_queue = max_queue
        self.mac_port: dict[bytes, int] = {}
        self.queue: collections.deque = collections.deque()   # (due, in_port, frame)
        self.queued_bytes = 0
        self.stats = {"frames_in": 0, "bytes_in": 0, "frames_out": 0, "dropped_queue_full": 0,
                      "dropped_send": 0, "dropped_loss": 0, "late_max_s": 0.0}
        self.loss_file, self.loss, self._loss_seen, self._loss_checked = loss_file, 0.0, None, 0.0
        self._random = random.Random(0)

    def _check_loss(self, now: float) -> None:
        """Read --loss-file again if it changed (a bad value is ignored, the old one kept)."""
        if self.loss_file is None or now - self._loss_checked < LOSS_POLL_S:
            return
        self._loss_checked = now
        try:
            stat = os.stat(self.loss_file)
            seen = (stat.st_mtime_ns, stat.st_size)
            if seen == self._loss_seen:
                return
            self._loss_seen = seen
            value = float(open(self.loss_file).read().strip() or 0)
        except (OSError, ValueError):
            return
        if 0.0 <= value <= 1.0:
            self.loss = value

    def _receive(self, i: int, now: float) -> None:
        sock = self.socks[i]
        while True:
            try:
                frame = sock.recv(FRAME_MAX)
            except BlockingIOError:
                return
            except OSError as exc:       # e.g. ENETDOWN while a namespace is being removed
                if exc.errno in (errno.ENETDOWN, errno.ENXIO):
                    return
                raise
            self.stats["frames_in"] += 1
            self.stats["bytes_in"] += len(frame)
            if len(frame) < VNET_HDR_LEN + 14:
                continue
            src = frame[VNET_HDR_LEN + 6: VNET_HDR_LEN + 12]
            self.mac_port[src] = i
            if self.loss and self._random.random() < self.loss:
                self.stats["dropped_loss"] += 1
                continue
            if self.queued_bytes + len(frame) > self.max_queue:
                self.stats["dropped_queue_full"] += 1
                continue
            self.queue.append((now + self.delay, i, frame))
            self.queued_bytes += len(frame)

    def _targets(self, in_port: int, frame: bytes) -> list[int]:
        dst = frame[VNET_HDR_LEN: VNET_HDR_LEN + 6]
        out = None if dst[0] & BROADCAST_BIT else self.mac_port.get(dst)
        if out is None:
            return [j for j in range(len(self.socks)) if j != in_port]
        return [] if out == in_port else [out]

    def _release(self, now: float) -> None:
        queue = self.queue
        while queue and queue[0][0] <= now:
            due, in_port, frame = queue.popleft()
            self.queued_bytes -= len(frame)
            self.stats["late_max_s"] = max(self.stats["late_max_s"], now - due)
            for j in self._targets(in_port, frame):
                try:
                    self.socks[j].send(frame)
                    self.stats["frames_out"] += 1
                except OSError:       # the port's qdisc is full (ENOBUFS) or it went down
                    self.stats["dropped_send"] += 1

    def serve(self, should_stop) -> None:
        socks = self.socks
        while not should_stop():
            now = time.monotonic()
            self._check_loss(now)
            self._release(now)
            timeout = max(0.0, self.queue[0][0] - now) if self.queue else LOSS_POLL_S
            readable, _, _ = select.select(socks, [], [], timeout)
            now = time.monotonic()
            for sock in readable:
                self._receive(self.index[sock.fileno()], now)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delay", required=True, help="one-way delay per frame, e.g. 0.5ms")
    parser.add_argument("--max-queue", type=int, default=64 << 20,
                        help="bytes held at most; frames beyond are dropped (default 64 MiB)")
    parser.add_argument("--loss-file", default=None,
                        help="a file holding the probability of dropping a frame (0..1)")
    parser.add_argument("ports", nargs="+", help="interfaces to switch between")
    args = parser.parse_args(argv)
    try:
        delay = parse_seconds(args.delay)
    except ValueError as exc:
        parser.error(f"--delay {args.delay}: need 0..10 s ({exc})")
    if not 0 <= delay <= 10:
        parser.error(f"--delay {args.delay}: need 0..10 s")
    switch = DelaySwitch(args.ports, delay, args.max_queue, args.loss_file)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    print("ready", flush=True)
    switch.serve(lambda: bool(stop))      # returns at most 0.5 s after a signal
    print(json.dumps(dict(switch.stats, ports=switch.names, delay_s=delay)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
