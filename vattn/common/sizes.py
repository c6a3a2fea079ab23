"""Byte sizes as people write them ("4GiB", "512MiB", "2e9") and as tables show them."""

from __future__ import annotations

import re
from decimal import Decimal

# Binary units (KiB, MiB, ...) and their one-letter forms (K, M, G, T, as in
# `4G`) are powers of 1024; KB, MB, GB, TB are powers of 1000.
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
MAX_BYTES = 2**64 - 1


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a number with an optional unit, e.g. ``"4GiB"``,
    ``"512 MiB"``, ``"4G"`` (= 4 GiB), ``"2e9"``, ``"1.5GB"``; an int passes
    through. Units: B, KiB/MiB/GiB/TiB and K/M/G/T (powers of 1024),
    KB/MB/GB/TB (powers of 1000), any case.

    Raises ValueError for anything else, a negative or fractional byte count,
    or more than 2**64 - 1 bytes.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"size must be a str such as '4GiB' or an int of bytes, got {type(text).__name__}")
    if isinstance(text, int):
        value = Decimal(text)
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"size {text!r} is not understood: write a number of bytes with an optional unit "
                             f"(B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), e.g. '4GiB', '512MiB', '2e9'")
        value = Decimal(match.group(1)) * _UNITS[unit]
    if value != value.to_integral_value():
        raise ValueError(f"size {text!r} is {value} bytes, not a whole number of bytes")
    if not 0 <= value <= MAX_BYTES:
        raise ValueError(f"size {text!r} must be in [0, 2**64 - 1] bytes")
    return int(value)


def format_bytes(n: int) -> str:
    """``n`` bytes for a table: "0 B", "812 B", "1.50 KiB", "512.0 MiB", "4.00 GiB"."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            return f"{n:.2f} {unit}" if n < 100 else f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
