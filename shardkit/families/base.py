"""A model family: the declarative table of which placement each Hugging Face tensor gets, and
the registry that family modules add themselves to (keyed by `model_type`).

A family is data: the placements of the embedding block (first pipeline stage), of one decoder
layer (with its index kept in the names, as NxD does), and of the final block (last stage), plus
the full tensor shapes a config implies.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..layout import Layout, ModelDims
from ..placements import Piece, Placement

LAYER_PREFIX = "model.layers.{i}."
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Family:
    """A model family's table. `shapes(dims)` gives the full shapes of `first`/`final` tensors by
    full name and of `layer` tensors by their name inside a layer."""

    name: str
    model_types: tuple[str, ...]
    first: tuple[Placement, ...]
    layer: tuple[Placement, ...]
    final: tuple[Placement, ...]
    shapes: Callable[[ModelDims], tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]]
    ignored: tuple[str, ...] = field(default_factory=tuple)

    def full_shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        """Every full tensor the config implies, in checkpoint order, with its shape."""
        global_shapes, layer_shapes = self.shapes(dims)
        out: dict[str, tuple[int, ...]] = {}
        for rule in self.first:
            for n in rule.sources(dims):
                out[n] = global_shapes[n]
        for i in range(dims.num_layers):
            prefix = LAYER_PREFIX.format(i=i)
            for rule in self.layer:
                for n in rule.sources(dims):
                    out[prefix + n] = layer_shapes[n]
        for rule in self.final:
            for n in rule.sources(dims):
                out[n] = global_shapes[n]
        return out

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        """The axis along which each full tensor is cut (0 for replicated ones)."""
        out: dict[str, int] = {}
        for rule in self.first + self.final:
            out.update(rule.split_dims(dims))
        for i in range(dims.num_layers):
            prefix = LAYER_PREFIX.format(i=i)
            for rule in self.layer:
                out.update({prefix + n: d for n, d in rule.split_dims(dims).items()})
        return out

    def rank_pieces(
        self, layout: Layout, dims: ModelDims, tp_rank: int, pp_rank: int,
        full_shapes: Mapping[str, tuple[int, ...]], ep_rank: int = 0,
    ) -> list[Piece]:
        """The pieces of one rank file, in NxD's order. Expert-parallel ranks other than 0 hold
        only their experts (the rest is identical on every ep rank and saved once, as NxD does)."""

        def emit(rules: tuple[Placement, ...], prefix: str) -> list[Piece]:
            out: list[Piece] = []
            for rule in rules:
                if ep_rank == 0 or rule.expert:
                    out += rule.pieces(prefix, layout, dims, tp_rank, full_shapes, ep_rank)
            return out

        pieces: list[Piece] = []
        if pp_rank == 0:
            pieces += emit(self.first, "")
        for i in layout.stage_layers(dims.num_layers)[pp_rank]:
            pieces += emit(self.layer, LAYER_PREFIX.format(i=i))
        if pp_rank == layout.pp - 1:
            pieces += emit(self.final, "")
        return pieces

    def is_ignored(self, name: str) -> bool:
        """Tensors some checkpoints carry that models recompute (e.g. rotary inv_freq)."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.ignored)




REGISTRY: dict[str, Family] = {}
"""model_type -> family; filled by `register` as each family module is imported."""


def register(family: Family) -> Family:
    """Add a family under each of its model types (a family module calls this on its table)."""
    for model_type in family.model_types:
        if REGISTRY.get(model_type, family) is not family:
            raise ValueError(f"model_type {model_type!r} is registered twice ({REGISTRY[model_type].name}, {family.name})")
        REGISTRY[model_type] = family
    return family


def layer_of(name: str) -> int | None:
    """The decoder layer index in a full tensor name, or None."""
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None
