"""Parse and format the sizes the CLI and the what-if queries take: ``"64k"``, ``"1M"``, ``"80GB"``.

Counts (sequence lengths, batch sizes) use decimal multipliers, because that is how people
say context lengths: ``"1k" == 1_000``, ``"64k" == 64_000``, ``"1M" == 1_000_000``,
``"1G" == 10**9``. A binary form is accepted too: ``"1Ki" == 1024``, ``"64Ki" == 65_536``,
``"1Mi" == 2**20``, and so are ``"2^20"``, ``"1e6"`` and ``"1_000_000"``.

Byte sizes follow SI/IEC strictly: ``"80GB" == 80 * 10**9``, ``"80GiB" == 80 * 2**30``;
``"B"`` may be omitted (``"24G"``, ``"24Gi"``). A device name (``"h100"``) is not a size;
use :func:`gradshard.cost.devices.get_device` for that.

Formatting (``format_bytes`` and friends) is :mod:`gradshard.units`, re-exported here.
"""

from __future__ import annotations

import math
import re

from gradshard.units import format_bytes, format_count, format_flops, format_seconds  # re-exported

__all__ = ["parse_count", "parse_counts", "parse_bytes", "format_count", "format_bytes", "format_flops",
           "format_seconds"]

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_NUMBER = r"(?P<num>[0-9][0-9_]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
_COUNT_RE = re.compile(_NUMBER + r"\s*(?P<unit>[kKmMgGtTpP]i?)?$")
_POWER_RE = re.compile(r"(?P<base>[0-9]+)\s*(?:\^|\*\*)\s*(?P<exp>[0-9]+)$")
_BYTES_RE = re.compile(_NUMBER + r"\s*(?P<unit>[kKmMgGtTpP]i?)?\s*[bB]?$")


def _scale(unit: str | None) -> int:
    u = (unit or "").lower()
    if u in _BINARY:
        return _BINARY[u]
    return _DECIMAL[u]


def _to_int(value: float, text: str, what: str) -> int:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} {text!r} must be a finite non-negative number")
    rounded = round(value)
    if abs(value - rounded) > 1e-9 * max(1.0, abs(value)):
        raise ValueError(f"{what} {text!r} is not a whole number ({value!r})")
    return int(rounded)


def _parse_with_unit(pattern: re.Pattern[str], s: str, what: str, use: str) -> int:
    """``s`` read by ``pattern`` (a number and an optional unit) as a whole ``what``."""
    m = pattern.match(s)
    if not m:
        raise ValueError(f"cannot read {s!r} as a {what}: use {use}")
    return _to_int(float(m["num"].replace("_", "")) * _scale(m["unit"]), s, what)


def parse_count(text: str | int) -> int:
    """``"64k" -> 64000``, ``"1M" -> 1000000``, ``"64Ki" -> 65536``, ``"2^20" -> 1048576``."""
    if isinstance(text, bool):
        raise TypeError("a count must be an int or a string, not a bool")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"count {text} must be non-negative")
        return text
    s = str(text).strip()
    m = _POWER_RE.match(s)
    if m:
        return int(m["base"]) ** int(m["exp"])
    return _parse_with_unit(_COUNT_RE, s, "count", "digits with an optional k/M/G/T suffix (decimal: 1k = 1000) "
                            "or Ki/Mi/Gi (binary: 1Ki = 1024), e.g. '64k', '1M', '2^20'")


def parse_counts(text: str | int | list | tuple) -> list[int]:
    """A comma-separated list of counts: ``"1k,64k,1M" -> [1000, 64000, 1000000]``."""
    if isinstance(text, (list, tuple)):
        return [parse_count(t) for t in text]
    if isinstance(text, int):
        return [parse_count(text)]
    parts = [p for p in str(text).replace(" ", "").split(",") if p]
    if not parts:
        raise ValueError(f"empty list of counts: {text!r}")
    return [parse_count(p) for p in parts]


def parse_bytes(text: str | int | float) -> int:
    """``"80GB" -> 80_000_000_000``, ``"80GiB" -> 85_899_345_920``, ``"512MiB"``, ``"24G"``, ``1e9``."""
    if isinstance(text, bool):
        raise TypeError("a byte size must be a number or a string, not a bool")
    if isinstance(text, (int, float)):
        return _to_int(float(text), str(text), "byte size")
    s = str(text).strip()
    return _parse_with_unit(_BYTES_RE, s, "byte size", "a number with a unit such as '80GB' (decimal, 10^9) "
                            "or '80GiB' (binary, 2^30), e.g. '24GB', '512MiB', '1.5TB'")
