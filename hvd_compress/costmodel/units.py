"""Parse and format sizes, rates and times with explicit units.

Why this module exists: the course's own worked example passes 32 M *bits* where it
writes "32MB", an 8x error that nobody notices because the numbers carry no units.
Here every quantity the user types must carry a unit, and every quantity we print
shows one. Internally everything is SI base units: bytes, bytes/second, seconds.

Accepted spellings (case matters, because m/M and b/B mean different things):

  sizes   32MiB  32MB  1.5GiB  256Mbit  4kB  512B  8bit  (a space before the unit is fine)
  rates   10Gbit/s  10Gbps  1.25GB/s  100MiB/s
  times   1ms  50us  50µs  2.5s  800ns  (and tc's 1msec 50usec 2sec)
  tc rates (parse_tc_rate, the emulator's --rate)   1gbit  100mbit  1mibit  (bits per second)

A bare number is refused unless the caller names its unit (default_unit=): the emulator's
delays and the benchmark's sizes have always read "0.5" as seconds and "4096" as bytes.

Rejected on purpose, with an error that says what to write instead:
  "32Mb"  (megabit or megabyte? write Mbit or MB)     "32KB" (1000 or 1024? write kB or KiB)
  "32"    (no unit)        "-1MB", "nanMB", "infMB"    "0Gbit/s" (a rate must be > 0)
"""
from __future__ import annotations

import math
import re

__all__ = [
    "UnitError",
    "parse_size",
    "parse_rate",
    "parse_time",
    "parse_tc_rate",
    "argument_type",
    "format_size",
    "format_rate",
    "format_time",
]


class UnitError(ValueError):
    """A quantity could not be read unambiguously."""


# Multipliers for prefixes. Decimal (SI) prefixes are powers of 1000, binary (IEC) of 1024.
_DECIMAL = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_PREFIXES = {**_DECIMAL, **_BINARY}

# Base units of information, in bytes.
_BYTE_WORDS = {"B": 1.0, "byte": 1.0, "bytes": 1.0}
_BIT_WORDS = {"bit": 1.0 / 8, "bits": 1.0 / 8}

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9,
               "sec": 1.0, "msec": 1e-3, "usec": 1e-6}    # the last three: tc's spellings
# tc(8) rates: bits per second, no "/s". tc reads "mbps" as megaBYTES per second: not accepted.
_TC_RATE_BITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
                 "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30}

# A non-negative decimal number (no sign, no nan/inf), then an optional space, then the unit.
_QUANTITY = re.compile(r"^\s*(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>\S*)\s*$")

_SIZE_EXAMPLES = "e.g. 32MiB, 32MB, 256Mbit, 4kB, 512B"
_RATE_EXAMPLES = "e.g. 10Gbit/s, 10Gbps, 1.25GB/s, 100MiB/s"
_TIME_EXAMPLES = "e.g. 1ms, 50us, 2.5s, 800ns"
_TC_RATE_EXAMPLES = "e.g. 100mbit, 1gbit, 10gbit"


def _split(text: str, kind: str, examples: str, default_unit: str | None = None
           ) -> tuple[float, str]:
    """Split '32 MiB' into (32.0, 'MiB'); reject non-numbers, and a missing unit unless the
    caller gave `default_unit`."""
    if not isinstance(text, str):
        raise UnitError(f"{kind} must be text with a unit ({examples}), got {text!r}")
    match = _QUANTITY.match(text)
    if match is None:
        raise UnitError(
            f"cannot read {text!r} as a {kind}: expected a non-negative number followed by a "
            f"unit ({examples})"
        )
    value = float(match.group("num"))
    if not math.isfinite(value):
        raise UnitError(f"{kind} {text!r} is too large to represent")
    unit = match.group("unit") or default_unit
    if not unit:
        raise UnitError(f"{kind} {text!r} has no unit: write it with one ({examples})")
    return value, unit


def _size_unit(unit: str, text: str, kind: str, examples: str) -> float:
    """Bytes per one `unit` ('MiB' -> 1048576, 'Mbit' -> 125000)."""
    for words in (_BYTE_WORDS, _BIT_WORDS):
        for word, per_unit in words.items():
            if unit.endswith(word):
                prefix = unit[: -len(word)]
                if prefix in _PREFIXES:
                    return _PREFIXES[prefix] * per_unit
                if prefix == "K":
                    raise UnitError(
                        f"{kind} {text!r} is ambiguous: 'K' means 1000 or 1024 depending on "
                        f"who wrote it; write k{word} (1000) or Ki{word} (1024)"
                    )
    # 'Mb', 'Gb/s', 'kb': a lower-case b is read as bit by some and byte by others.
    if unit.endswith("b") and unit[:-1] in _PREFIXES:
        return _ambiguous_b(unit, text, kind)
    raise UnitError(f"unknown unit {unit!r} in {kind} {text!r} ({examples})")


def _ambiguous_b(unit: str, text: str, kind: str) -> float:
    prefix = unit[:-1]
    raise UnitError(
        f"{kind} {text!r} is ambiguous: {unit!r} is read as bits by some and bytes by "
        f"others; write {prefix}bit (bits) or {prefix}B (bytes)"
    )


def parse_size(text: str, default_unit: str | None = None) -> float:
    """Bytes in `text`, e.g. '32MiB' -> 33554432.0, '256Mbit' -> 32000000.0; a bare number
    only with `default_unit` (e.g. 'B')."""
    value, unit = _split(text, "size", _SIZE_EXAMPLES, default_unit)
    if unit.endswith("/s") or unit.endswith("ps"):
        raise UnitError(f"{text!r} is a rate, not a size ({_SIZE_EXAMPLES})")
    return value * _size_unit(unit, text, "size", _SIZE_EXAMPLES)


def parse_rate(text: str) -> float:
    """Bytes per second in `text`, e.g. '10Gbit/s' -> 1.25e9, '1.25GB/s' -> 1.25e9.

    'bps' (bits per second, as network vendors write it) is accepted: '10Gbps' = 10 Gbit/s.
    A rate must be strictly positive: a link with zero bandwidth never finishes.
    """
    value, unit = _split(text, "rate", _RATE_EXAMPLES)
    if unit.endswith("/s"):
        per_second = _size_unit(unit[:-2], text, "rate", _RATE_EXAMPLES)
    elif unit.endswith("bps") and unit[:-3] in _PREFIXES:
        per_second = _PREFIXES[unit[:-3]] / 8
    elif unit.endswith("Bps") and unit[:-3] in _PREFIXES:
        raise UnitError(
            f"rate {text!r}: 'Bps' is easily misread as bits per second; "
            f"write {unit[:-3]}B/s (bytes) or {unit[:-3]}bit/s (bits)"
        )
    else:
        raise UnitError(f"{text!r} is not a rate: it needs a '/s' unit ({_RATE_EXAMPLES})")
    rate = value * per_second
    if rate <= 0:
        raise UnitError(f"rate {text!r} must be greater than zero")
    return rate


def parse_time(text: str, default_unit: str | None = None) -> float:
    """Seconds in `text`, e.g. '1ms' -> 0.001, '50us' -> 5e-05; a bare number only with
    `default_unit` (e.g. 's')."""
    value, unit = _split(text, "time", _TIME_EXAMPLES, default_unit)
    if unit not in _TIME_UNITS:
        raise UnitError(f"unknown time unit {unit!r} in {text!r} ({_TIME_EXAMPLES})")
    return value * _TIME_UNITS[unit]


def parse_tc_rate(text: str) -> float:
    """Bytes per second in a rate spelled as tc(8) writes it: '1gbit' -> 1.25e8.

    Lower-case bit units only ('100mbit', '1gbit', '1mibit'), as the emulator's --rate takes
    them; 'mbps' is refused: tc would read it as megabytes per second.
    """
    value, unit = _split(text.lower() if isinstance(text, str) else text, "rate",
                         _TC_RATE_EXAMPLES)
    if unit not in _TC_RATE_BITS:
        raise UnitError(f"bad rate {text!r}: use a number and one of "
                        f"{', '.join(_TC_RATE_BITS)} ({_TC_RATE_EXAMPLES})")
    return value * _TC_RATE_BITS[unit] / 8


def _scaled(value: float, steps: list[tuple[float, str]], digits: int) -> str:
    """Print `value` with the largest unit in `steps` that keeps it >= 1."""
    for scale, name in steps:
        if abs(value) >= scale * (1 - 1e-9):  # 1/(1/x) may land a hair below x
            return f"{value / scale:.{digits}g} {name}"
    scale, name = steps[-1]
    return f"{value / scale:.{digits}g} {name}"


def format_size(nbytes: float, digits: int = 4) -> str:
    """'33554432' -> '32 MiB'. Binary units, because tensors are sized in powers of two."""
    if nbytes == 0:
        return "0 B"
    steps = [(2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "B")]
    return _scaled(nbytes, steps, digits)


def format_rate(bytes_per_second: float, digits: int = 4) -> str:
    """1.25e9 -> '10 Gbit/s'. Links are sold in decimal bits per second, so print that."""
    bits = bytes_per_second * 8
    steps = [(1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s"), (1.0, "bit/s")]
    return _scaled(bits, steps, digits)


def format_time(seconds: float, digits: int = 4) -> str:
    """0.0462 -> '46.2 ms'."""
    if seconds == 0:
        return "0 s"
    if not math.isfinite(seconds):
        return f"{seconds} s"
    steps = [(1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")]
    return _scaled(seconds, steps, digits)


def argument_type(parse):
    """A units parser as an argparse type: its own message printed as the usage error (exit 2),
    not argparse's "invalid parse_rate value"."""
    import argparse

    def convert(text):
        try:
            return parse(text)
        except UnitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__.replace("parse_", "")
    return convert
