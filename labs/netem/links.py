"""How one emulated link is shaped (rate, delay, MTU) and the tbf qdisc that limits its rate.

Pure: no namespaces are touched here. Rates and times are read by the plugin's units module
(hvd_compress.costmodel.units), so the emulator, the benchmark and the cost model share one
spelling of every quantity.
"""
from __future__ import annotations

import dataclasses

from hvd_compress.costmodel import units
from hvd_compress.costmodel.model import Link

DELAY_VIA = ("auto", "netem", "bridge")

# Token bucket sizing.  The bucket must hold at least one full frame (else tbf drops it) and
# enough bytes that the timer that refills it need not fire every microsecond at 10 Gbit/s;
# too big a bucket lets short messages pass faster than the link rate.  The queue must be
# long enough that TCP rarely sees a local drop.
BURST_SECONDS = 1e-3
QUEUE_SECONDS = 50e-3
MIN_QUEUE_BYTES = 256 * 1024


class NetemError(RuntimeError):
    """A clear, user-facing error (bad argument, missing privilege or kernel feature)."""


# ----------------------------------------------------------------------------------------
# Parsing link parameters (pure)
# ----------------------------------------------------------------------------------------

def parse_rate(text: str | None) -> float | None:
    """'1gbit' -> 1e9 bits/s; None, '', '0' or 'none' -> None (unlimited).

    Only bit units are accepted (units.parse_tc_rate): tc reads 'mbps' as megaBYTES per second.
    """
    if text is None or str(text).strip().lower() in ("", "0", "none", "inf", "unlimited"):
        return None
    try:
        bps = units.parse_tc_rate(str(text)) * 8
    except units.UnitError as exc:
        raise NetemError(str(exc)) from None
    if bps < 8e3:
        raise NetemError(f"rate {text!r} is below 8 kbit/s; nothing useful runs that slowly")
    return bps


def parse_duration(text: str | None) -> float:
    """'0.5ms' -> 0.0005 s; a bare number is seconds; None or '' -> 0."""
    if text is None or str(text).strip() == "":
        return 0.0
    try:
        seconds = units.parse_time(str(text).lower(), default_unit="s")
    except units.UnitError as exc:
        raise NetemError(f"bad duration {text!r}: use a number and s, ms or us "
                         f"(e.g. 0.5ms): {exc}") from None
    if seconds > 10:
        raise NetemError(f"delay {text!r} is over 10 s; that is not a network")
    return seconds


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """What every rank's NIC looks like: rate in bit/s (None = unlimited), one-way delay in s,
    and what adds the delay: the kernel's netem qdisc, the userspace delay bridge, or "auto"
    (netem where the kernel has it).

    Not named Link: that is the cost model's alpha/beta link (hvd_compress.costmodel.Link),
    what a shaped link should measure as; `cost_link()` gives it. This one is how to build it.
    """
    rate_bps: float | None = None
    delay_s: float = 0.0
    mtu: int = 1500
    delay_via: str = "auto"

    @classmethod
    def parse(cls, rate: str | None, delay: str | None = None, mtu: int = 1500,
              delay_via: str = "auto") -> "LinkShape":
        if not 576 <= mtu <= 65535:
            raise NetemError(f"mtu {mtu} out of range 576..65535")
        if delay_via not in DELAY_VIA:
            raise NetemError(f"--delay-via {delay_via!r}: one of {', '.join(DELAY_VIA)}")
        return cls(parse_rate(rate), parse_duration(delay), mtu, delay_via)

    def resolved(self, netem_available: bool) -> "LinkShape":
        """This link with delay_via 'auto' replaced by what will really add the delay."""
        if self.delay_via != "auto":
            return self
        return dataclasses.replace(self, delay_via="netem" if netem_available else "bridge")

    @property
    def uses_bridge(self) -> bool:
        return self.delay_s > 0 and self.delay_via == "bridge"

    def cost_link(self) -> Link:
        """The cost model's view of this shape: alpha = the one-way delay, 1/beta = the rate
        (ignores per-message software cost, which fit.py measures)."""
        if self.rate_bps is None:
            raise NetemError("an unlimited link has no cost-model bandwidth")
        return Link.from_bandwidth(self.delay_s, self.rate_bps / 8)

    def describe(self) -> str:
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e6:g} Mbit/s"
        via = f" (via {self.delay_via})" if self.delay_s > 0 else ""
        return f"rate {rate}, delay {self.delay_s * 1e3:g} ms{via}, mtu {self.mtu}"


def tbf_args(rate_bps: float, mtu: int) -> list[str]:
    """Arguments of a tbf qdisc for `rate_bps` (see the BURST/QUEUE constants for why)."""
    rate_Bps = rate_bps / 8
    burst = int(max(rate_Bps * BURST_SECONDS, 2 * (mtu + 14)))
    limit = int(max(rate_Bps * QUEUE_SECONDS, MIN_QUEUE_BYTES, 4 * burst))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]

