"""The one size grammar (`5GB`, `5GiB`, `5G`, `500MB`, bytes) and the one byte formatter.

Decimal units (KB, MB, GB, TB, PB) are powers of 1000, binary ones (KiB... and the bare K, M, G,
T, P, as in `free -h`) powers of 1024. Case and spaces do not matter.
"""

from __future__ import annotations

import re

from .errors import ShardkitError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS.update({_p: 1024**_i, _p + "i": 1024**_i, _p + "ib": 1024**_i, _p + "b": 1000**_i})


def parse_size(text: str | int, *, what: str = "size", require_unit: bool = False) -> int:
    """Bytes from a size: 16GiB = 16 x 2**30, 16GB = 16 x 10**9, 32G = 32 x 2**30, 17179869184
    = bytes. With `require_unit`, a bare number is refused (a memory size of "16" is a slip for
    16 GiB far more often than a wish for 16 bytes)."""
    if isinstance(text, bool):
        raise ShardkitError(f"{what} {text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ShardkitError(f"{what} {text} is negative")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ShardkitError(
            f"{what} {text!r} is not understood: write a number with a unit, e.g. 16GiB (2**30), 16GB (10**9), "
            "32G (= 32GiB) or 500MB"
        )
    if require_unit and not unit:
        raise ShardkitError(f"{what} {text!r} has no unit: give a unit, e.g. {text}GiB or {text}GB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """Binary units with two decimals: 1.07 GiB; plain bytes below 1 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
