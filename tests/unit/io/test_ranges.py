"""Byte-range sets of a mirror file (`io.objects.ranges`): what is fetched (`Ranges`) and which
parts are being fetched (`Claimed`), checked against a plain list of every byte."""

from __future__ import annotations

import random

from shardkit.io.objects.ranges import Claimed, Ranges


def test_ranges_missing_is_what_no_added_range_covers():
    rng = random.Random(5)
    for _ in range(200):
        ranges, covered = Ranges(), [False] * 200
        for _ in range(rng.randrange(8)):
            start = rng.randrange(200)
            end = rng.randrange(start, 201)
            ranges.add(start, end)
            covered[start:end] = [True] * (end - start)
        start = rng.randrange(200)
        end = rng.randrange(start, 201)
        missing = [i for s, e in ranges.missing(start, end) for i in range(s, e)]
        assert missing == [i for i in range(start, end) if not covered[i]]


def test_claimed_finds_exactly_the_parts_that_overlap():
    rng = random.Random(7)
    for _ in range(200):
        claimed, held = Claimed(), {}
        free = list(range(0, 400, 10))
        rng.shuffle(free)
        for start in free[: rng.randrange(len(free))]:
            end = start + rng.randrange(1, 11)
            claimed.add(start, end, f"part {start}")
            held[start] = end
        for start in list(held)[: rng.randrange(len(held) + 1)]:
            claimed.pop(start, held.pop(start))
        claimed.pop(3, 4)  # not held: nothing happens
        assert len(claimed) == len(held)
        start = rng.randrange(400)
        end = rng.randrange(start + 1, 402)
        want = sorted((s, e, f"part {s}") for s, e in held.items() if s < end and e > start)
        assert claimed.overlapping(start, end) == want


def test_claimed_among_the_parts_of_a_large_object():
    """A 1 TiB object is 32768 parts of 32 MiB, every one looked up by each claim of a range."""
    claimed, part = Claimed(), 32 << 20
    for i in range(32768):
        assert claimed.overlapping(i * part, (i + 1) * part) == []
        claimed.add(i * part, (i + 1) * part, i)
    assert len(claimed) == 32768
    assert [v for _, _, v in claimed.overlapping(5 * part + 1, 7 * part)] == [5, 6]
    assert [v for _, _, v in claimed.overlapping(32767 * part, 1 << 40)] == [32767]
