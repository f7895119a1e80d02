"""Output-file planning: which files an operation writes and the pieces each holds.

Sharded outputs are NxD rank files (one per (ep, tp, pp) rank of the layout); a Hugging Face
output is safetensors files of full tensors split by size, as transformers names them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..conventions import HF
from ..errors import ShardkitError
from ..families import Family
from ..formats import get_format, hf, nxd
from ..formats.base import TensorSpec
from ..layout import Layout, ModelDims
from ..placements import Piece, Segment, make_piece
from ..sizes import parse_size


@dataclass(frozen=True)
class Leaf:
    """A tensor of an object file (`FileBody`): read from a source `piece` and made what is written
    by `then` (a new tensor: a dp shard, say), or a constant `value`."""

    spec: TensorSpec
    piece: Piece | None = None
    then: Callable[[torch.Tensor], torch.Tensor] | None = None
    value: torch.Tensor | None = None


@dataclass(frozen=True)
class FileBody:
    """An object file's own shape (a ZeRO-1 optimizer shard, where a rank file is a state dict):
    its tensors in the order they are written (`leaves`), torch.save's data.pkl of the object with
    each tensor stubbed (`data_pkl`), and for xser the reference object and `.info.pt` (`refs`,
    `info`). A format writes it when its registry entry has an `objects` writer."""

    leaves: tuple[Leaf, ...]
    data_pkl: bytes | None = None
    refs: Any = None
    info: Any = None


@dataclass
class OutputFile:
    """One file to write: its path under the output root and the pieces it holds, in order. An
    object file has a `body` (its pieces are those its leaves read); files with the same
    `together` key are built in lockstep, a tensor of each in turn, so that a piece read once
    serves them all (a rank's dp optimizer shards)."""

    path: str
    pieces: list[Piece]
    rank: tuple[int, int, int] | None = None
    body: FileBody | None = None
    together: Any = None

    @classmethod
    def of_body(cls, path: str, body: FileBody, together: Any = None) -> OutputFile:
        """An object file: its pieces are its leaves' (each once)."""
        pieces = list({id(leaf.piece): leaf.piece for leaf in body.leaves if leaf.piece is not None}.values())
        return cls(path, pieces, None, body, together)

    @property
    def expert_parallel(self) -> list[str]:
        return [p.name for p in self.pieces if p.expert]

    @property
    def nbytes(self) -> int | None:
        """The bytes of an object file's tensors (None for a rank file: its dtypes are planned)."""
        return sum(leaf.spec.nbytes for leaf in self.body.leaves) if self.body is not None else None


def plan_sharded(
    family: Family, dims: ModelDims, layout: Layout, fmt: str, convention: str | None = None
) -> list[OutputFile]:
    """Rank files of `layout` (NxD names), each with its pieces; or the files a format that lays
    out its own plans (DCP, under a naming `convention`)."""
    own = get_format(fmt).plan
    if own is not None:
        return [OutputFile(path, pieces, rank) for path, pieces, rank in own(family, dims, layout, convention)]
    if convention not in (None, HF):
        raise ShardkitError(f"--convention {convention} names tensors in --format dcp only; {fmt} keeps NxD's names")
    layout.validate(dims)
    shapes = family.full_shapes(dims)
    outputs = []
    for ep, tp, pp in layout.ranks():
        pieces = family.rank_pieces(layout, dims, tp, pp, shapes, ep)
        outputs.append(OutputFile(nxd.rank_file_name(ep, tp, pp, layout, fmt), pieces, (ep, tp, pp)))
    return outputs


def plan_full(
    family: Family, dims: ModelDims, itemsize: int, max_shard_size: int | str
) -> tuple[list[OutputFile], dict | None]:
    """Hugging Face safetensors files holding every full tensor, split by size."""
    shapes = family.full_shapes(dims)
    split_dims = family.split_dims(dims)
    pieces = {}
    for name, shape in shapes.items():
        dim = split_dims[name]
        pieces[name] = make_piece(name, [Segment(name, dim, 0, shape[dim] if shape else 1)], shapes)
    sizes = {n: p.numel() * itemsize for n, p in pieces.items()}
    # one size grammar (5GB, 5GiB, 5G, bytes): huggingface_hub's splitter gets bytes
    files, index = hf.split_into_files(sizes, parse_size(max_shard_size, what="max shard size"))
    return [OutputFile(f, [pieces[n] for n in names]) for f, names in files.items()], index
