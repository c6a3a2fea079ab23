"""Byte sizes as people write them ("4GiB", "512MiB", "2e9") and as tables show them."""

from __future__ import annotations

import re
from decimal import Context, Decimal, DecimalException

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
# Exact for every count of bytes up to 2**64 times the largest unit (2**40, 13
# digits): more digits than that already fail the range check. Exponents are
# checked against the range before any arithmetic, so 1e9999999 cannot overflow.
_EXACT = Context(prec=60, Emax=10**6, Emin=-(10**6), traps=[])


def parse_size(text: str | int, minimum: int = 0) -> int:
    """Bytes in ``text``: a number with an optional unit, e.g. ``"4GiB"``,
    ``"512 MiB"``, ``"4G"`` (= 4 GiB), ``"2e9"``, ``"1.5GB"``; an int passes
    through. Units: B, KiB/MiB/GiB/TiB and K/M/G/T (powers of 1024),
    KB/MB/GB/TB (powers of 1000), any case.

    Raises ValueError for anything else, a fractional byte count, or a count
    outside ``[minimum, 2**64 - 1]`` bytes (negative ones, and ones too large
    for any arithmetic such as ``1e9999999``, included).
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"size must be a str such as '4GiB' or an int of bytes, got {type(text).__name__}")
    out_of_range = ValueError(f"size {text!r} must be in [{minimum}, 2**64 - 1] bytes")
    if isinstance(text, int):
        value = Decimal(text)
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"size {text!r} is not understood: write a number of bytes with an optional unit "
                             f"(B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), e.g. '4GiB', '512MiB', '2e9'")
        number = Decimal(match.group(1))
        if number.is_signed() and number != 0:
            raise out_of_range
        if number != 0 and number.adjusted() > 20:  # 10**21 bytes or more: past 2**64 in any unit
            raise out_of_range
        if number != 0 and number.adjusted() < -20:  # below 1e-20 of even a TiB: not a whole byte
            raise ValueError(f"size {text!r} is not a whole number of bytes")
        try:
            value = _EXACT.multiply(number, Decimal(_UNITS[unit]))
        except DecimalException:
            raise out_of_range from None
    if value != value.to_integral_value():
        raise ValueError(f"size {text!r} is {value} bytes, not a whole number of bytes")
    if not minimum <= value <= MAX_BYTES:
        raise out_of_range
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
