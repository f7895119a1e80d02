"""Output-file planning: which files an operation writes and the pieces each holds.

Sharded outputs are NxD rank files (one per (ep, tp, pp) rank of the layout); a Hugging Face
output is safetensors files of full tensors split by size, as transformers names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..conventions import HF
from ..errors import ShardkitError
from ..families import Family
from ..formats import get_format, hf, nxd
from ..layout import Layout, ModelDims
from ..placements import Piece, Segment, make_piece
from ..sizes import parse_size


@dataclass
class OutputFile:
    """One file to write: its path under the output root and the pieces it holds, in order."""

    path: str
    pieces: list[Piece]
    rank: tuple[int, int, int] | None = None

    @property
    def expert_parallel(self) -> list[str]:
        return [p.name for p in self.pieces if p.expert]


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
