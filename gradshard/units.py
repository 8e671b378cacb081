"""How gradshard writes quantities for people: bytes, FLOPs, seconds and counts.

One place for every report, table and summary (``gs.measure``, the cost model, the CLI), so the
same number always reads the same way. Three significant digits, no trailing zeros::

    format_bytes(8008)          -> '7.82 KiB'     (binary units, as allocators report them)
    format_bytes(80 * 2**30)    -> '80 GiB'
    format_flops(2.4e12)        -> '2.4 TFLOP'     (decimal units)
    format_seconds(0.0123)      -> '12.3 ms'
    format_count(65536)         -> '65.5k'         (decimal, as people say context lengths)

Parsing the same units back (``"64k"``, ``"80GB"``) lives in :mod:`gradshard.cost.units`.
"""

from __future__ import annotations

import math

__all__ = ["format_bytes", "format_count", "format_flops", "format_seconds"]

_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_FLOP_UNITS = ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP"))
_COUNT_UNITS = ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k"))


def format_bytes(n: float) -> str:
    """Binary units, three significant digits: ``1023 -> '1023 B'``, ``1536 -> '1.5 KiB'``."""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in _BYTE_UNITS:
        n /= 1024.0
        if abs(n) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """Decimal units, three significant digits: ``2.4e12 -> '2.4 TFLOP'``, ``12 -> '12 FLOP'``."""
    n = float(n)
    for div, unit in _FLOP_UNITS:
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} FLOP"


def format_seconds(s: float) -> str:
    """``0.0123 -> '12.3 ms'``, ``3.0 -> '3 s'``, ``4000 -> '1.11 h'``."""
    if s != s or s == math.inf:
        return str(s)
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def format_count(n: float) -> str:
    """``65536 -> '65.5k'``, ``1_000_000 -> '1M'``, ``12 -> '12'`` (decimal, as people say it)."""
    n = float(n)
    for div, suffix in _COUNT_UNITS:
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}" if n == int(n) else f"{n:.3g}"
