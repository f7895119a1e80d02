"""Helpers of the DCP tests (tests/system/golden: test_dcp, test_titan): what torch's own DCP reader
makes of a folder, and a tensor saved again as other chunks (tiles) the way torch saves them."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch


def torch_reads(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """What torch's own DCP reader makes of a folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp)
    return torch.load(tmp, weights_only=True)


def retile(folder: Path, fqn: str, tiles: list[tuple[list[int], list[int]]], full: torch.Tensor) -> None:
    """Save the tensor `fqn` of a DCP folder (its values `full`) again as the chunks `tiles`
    ((offsets, sizes) each: that box of `full`), as torch's `FileSystemWriter` saves chunks (each
    one's `torch.save` archive appended to a data file, here a new `__99_0.distcp`), its `.metadata`
    entry and storage listing rewritten with torch's own classes; shardkit's manifest is dropped."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    meta = pickle.loads((folder / ".metadata").read_bytes())
    entry = meta.state_dict_metadata[fqn]
    assert tuple(entry.size) == tuple(full.shape)
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if k.fqn != fqn}
    entry.chunks = []
    with open(folder / "__99_0.distcp", "wb") as data:
        for index, (offsets, sizes) in enumerate(tiles):
            start = data.tell()
            torch.save(full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone(), data)
            entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            meta.storage_data[MetadataIndex(fqn, offsets, index)] = _StorageInfo(
                "__99_0.distcp", start, data.tell() - start
            )
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    (folder / "shardkit.json").unlink(missing_ok=True)


def bands(size: int, count: int) -> list[tuple[int, int]]:
    """[0, size) cut into `count` consecutive uneven (start, length) bands."""
    cuts = [size * i // count for i in range(count + 1)]
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


def grid(shape: tuple[int, int], rows: int, cols: int) -> list[tuple[list[int], list[int]]]:
    """A rows x cols grid of uneven tiles of a 2-D shape, in a scrambled order."""
    tiles = [([r, c], [h, w]) for r, h in bands(shape[0], rows) for c, w in bands(shape[1], cols)]
    return tiles[::7] + [t for i, t in enumerate(tiles) if i % 7]


def _miscounted(tiles: list) -> list:
    """The same tiles with one missing and another listed twice: the same count and volume."""
    first = tiles[3]
    twin = next(i for i, t in enumerate(tiles) if i != 3 and t[1] == first[1])
    return [first if i == twin else t for i, t in enumerate(tiles)]
