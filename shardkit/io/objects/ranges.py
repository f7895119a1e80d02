"""Sets of byte ranges: which bytes of a file are fetched, read, or given back (`io.objects.remote`)."""

from __future__ import annotations

import bisect
from typing import Any


class Ranges:
    """Disjoint, sorted [start, end) ranges."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [start], [end]

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) not covered."""
        out: list[tuple[int, int]] = []
        i = bisect.bisect_right(self.ends, start)
        pos = start
        while pos < end and i < len(self.starts):
            if self.starts[i] >= end:
                break
            if self.starts[i] > pos:
                out.append((pos, self.starts[i]))
            pos = max(pos, self.ends[i])
            i += 1
        if pos < end:
            out.append((pos, end))
        return out

    def remove(self, start: int, end: int) -> None:
        kept = [(s, e) for s, e in zip(self.starts, self.ends) if e <= start or s >= end]
        kept += [(s, start) for s, e in zip(self.starts, self.ends) if s < start < e]
        kept += [(end, e) for s, e in zip(self.starts, self.ends) if s < end < e]
        kept.sort()
        self.starts, self.ends = [s for s, _ in kept], [e for _, e in kept]

    def within(self, start: int, end: int) -> list[tuple[int, int]]:
        """The covered parts of [start, end)."""
        i = bisect.bisect_right(self.ends, start)
        out: list[tuple[int, int]] = []
        while i < len(self.starts) and self.starts[i] < end:
            out.append((max(start, self.starts[i]), min(end, self.ends[i])))
            i += 1
        return out

    def run_from(self, pos: int) -> int:
        """The end of the covered range holding `pos` (`pos` itself when it is not covered)."""
        i = bisect.bisect_right(self.starts, pos) - 1
        return self.ends[i] if i >= 0 and self.ends[i] > pos else pos

    def total(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))


class Claimed:
    """Disjoint [start, end) ranges, each with what stands for it (a part's fetch), found by
    overlap in logarithmic time: a 1 TiB object is 32768 parts, and every claim looks them up."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.held: dict[int, tuple[int, Any]] = {}  # start -> (end, value)

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, start: int, end: int, value: Any) -> None:
        """Hold [start, end) (overlapping none held)."""
        if start not in self.held:
            bisect.insort(self.starts, start)
        self.held[start] = (end, value)

    def pop(self, start: int, end: int) -> None:
        """Forget [start, end), when it is held."""
        if self.held.get(start, (None,))[0] == end:
            del self.held[start]
            del self.starts[bisect.bisect_left(self.starts, start)]

    def overlapping(self, start: int, end: int) -> list[tuple[int, int, Any]]:
        """The held ranges that overlap [start, end), in order."""
        out: list[tuple[int, int, Any]] = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.starts) and self.starts[i] < end:
            first = self.starts[i]
            last, value = self.held[first]
            if last > start:
                out.append((first, last, value))
            i += 1
        return out


def whole_parts(ranges: list[tuple[int, int]], size: int, part: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The `part`-aligned spans (within `size`) holding sorted `ranges`, overlapping ones joined,
    each with the ranges inside it."""
    out: list[tuple[int, int, list[tuple[int, int]]]] = []
    for s, e in ranges:
        start, end = s - s % part, min(size, -(-e // part) * part)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]), [*out[-1][2], (s, e)])
        else:
            out.append((start, end, [(s, e)]))
    return out
