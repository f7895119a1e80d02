"""A model family: the declarative table of which placement each Hugging Face tensor gets, and
the registry that family modules add themselves to (keyed by `model_type`).

A family is data: the placements of the embedding block (first pipeline stage), of one decoder
layer (with its index kept in the names, as NxD does), and of the final block (last stage). Each
placement declares the full shape of every tensor it consumes, so the table names each tensor
once and `full_shapes` is derived from it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigMismatchError, LayoutError
from ..layout import FULL, QKV_STYLES, Layout, ModelDims
from ..placements import QKV_NAMES, HeadGroups, Piece, Placement, Segment, Split

LAYER_PREFIX = "model.layers.{i}."
Shapes = Mapping[str, tuple[int, ...]]  # full tensor name -> shape


@dataclass(frozen=True)
class Family:
    """A model family's table: placements of the first block (full names), of one layer (names
    inside a layer, under `layer_prefix`) and of the final block.

    `qkv_styles` are the layout qkv styles the family can be stored in (the others are refused
    with `qkv_reason`); `check` refuses configs the table cannot express, with the reason."""

    name: str
    first: tuple[Placement, ...]
    layer: tuple[Placement, ...]
    final: tuple[Placement, ...]
    model_types: tuple[str, ...] = ()  # the config model_type values it reads (default: its name)
    ignored: tuple[str, ...] = field(default_factory=tuple)
    layer_prefix: str = LAYER_PREFIX
    qkv_styles: tuple[str, ...] = QKV_STYLES
    qkv_reason: str = ""
    check: Callable[[ModelDims], str | None] | None = None
    # the table a config's `architectures` asks for, when it is not this one (BERT's heads); None: this one
    variant: Callable[[Mapping[str, Any]], Family | None] | None = None

    def __post_init__(self) -> None:
        if not self.model_types:
            object.__setattr__(self, "model_types", (self.name,))

    def full_shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        """Every full tensor the config implies, in checkpoint order, with its shape (as the
        placements declare them)."""
        self.check_dims(dims)
        out: dict[str, tuple[int, ...]] = {}

        def add(rules: tuple[Placement, ...], prefix: str) -> None:
            for rule in rules:
                for n, shape in rule.shapes(dims).items():
                    if prefix + n in out:
                        raise ValueError(f"family {self.name}: {prefix + n} is placed twice")
                    out[prefix + n] = shape

        add(self.first, "")
        for i in range(dims.num_layers):
            add(self.layer, self.layer_prefix.format(i=i))
        add(self.final, "")
        return out

    def check_dims(self, dims: ModelDims) -> None:
        """Refuse (ConfigMismatchError, with the reason) a config this family's table cannot
        express; apart from `full_shapes` so that a caller can check without sizing every layer."""
        if self.check is not None and (reason := self.check(dims)):
            raise ConfigMismatchError(f"{self.name}: {reason}")

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        """The axis along which each full tensor is cut (0 for replicated ones)."""
        out: dict[str, int] = {}
        for rule in self.first + self.final:
            out.update(rule.split_dims(dims))
        for i in range(dims.num_layers):
            prefix = self.layer_prefix.format(i=i)
            for rule in self.layer:
                out.update({prefix + n: d for n, d in rule.split_dims(dims).items()})
        return out

    def check_layout(self, layout: Layout, dims: ModelDims | None = None) -> None:
        """Refuse, with the one-line reason, a qkv style this family cannot be stored in and (with
        `dims`) a tp that does not split the vocabulary when the family splits it over tp."""
        if layout.qkv not in self.qkv_styles:
            raise LayoutError(
                f"--qkv {layout.qkv} does not apply to {self.name}: {self.qkv_reason or 'use ' + ', '.join(self.qkv_styles)}"
            )
        if dims is not None and self.splits_vocab() and dims.vocab_size % layout.tp:
            raise LayoutError(
                f"vocab size {dims.vocab_size} is not divisible by tp {layout.tp}: "
                f"pad the vocabulary to a multiple of {layout.tp}"
            )

    def splits_vocab(self) -> bool:
        """Whether the embedding or the lm_head is vocab-parallel (a Split of its vocab rows over
        tp), by the family's placements; BERT's are replicated."""
        return any(
            isinstance(rule, Split) and rule.dim == 0 and rule.shape[:1] == ("vocab_size",)
            for rule in self.first + self.final
        )

    def validate(self, layout: Layout, dims: ModelDims) -> None:
        """Raise LayoutError with the reason when `layout` cannot hold this family's model of `dims`
        (Layout.validate's rules, then the family's own: `check_layout`)."""
        layout.validate(dims)
        self.check_layout(layout, dims)

    def rank_pieces(
        self, layout: Layout, dims: ModelDims, tp_rank: int, pp_rank: int, full_shapes: Shapes, ep_rank: int = 0
    ) -> list[Piece]:
        """The pieces of one rank file, in NxD's order. Expert-parallel ranks other than 0 hold
        only their experts (the rest is identical on every ep rank and saved once, as NxD does)."""
        self.check_layout(layout, dims)
        pieces: list[Piece] = []
        if pp_rank == 0:
            pieces += self.block_pieces("first", layout, dims, tp_rank, full_shapes, ep_rank)
        for i in layout.stage_layers(dims.num_layers)[pp_rank]:
            pieces += self.block_pieces("layer", layout, dims, tp_rank, full_shapes, ep_rank, layer=i)
        if pp_rank == layout.pp - 1:
            pieces += self.block_pieces("final", layout, dims, tp_rank, full_shapes, ep_rank)
        return pieces

    def block_pieces(
        self,
        block: str,
        layout: Layout,
        dims: ModelDims,
        tp_rank: int,
        full_shapes: Shapes,
        ep_rank: int = 0,
        layer: int = 0,
    ) -> list[Piece]:
        """One rank's pieces of one block: "first" (stage 0's), decoder layer `layer` ("layer") or
        "final" (the last stage's). A stage is its blocks in order (`rank_pieces`); `shardkit
        plan` prices each block once, as every layer is cut from the same table."""
        rules, prefix = {
            "first": (self.first, ""),
            "layer": (self.layer, self.layer_prefix.format(i=layer)),
            "final": (self.final, ""),
        }[block]
        out: list[Piece] = []
        for rule in rules:
            if ep_rank == 0 or rule.expert:
                out += rule.pieces(prefix, layout, dims, tp_rank, full_shapes, ep_rank)
        return out

    def k_source(self, dims: ModelDims, layer: int) -> Segment | None:
        """The rows of the full tensor that hold all of `layer`'s k heads (k_proj, or the k rows
        inside a fused qkv tensor: Phi-3's qkv_proj, DBRX's Wqkv), as the family's attention
        placement cuts them; None for a family without kv heads (no HeadGroups)."""
        prefix = self.layer_prefix.format(i=layer)
        k_name = QKV_NAMES["separate"][0][1]
        for rule in self.layer:
            if not isinstance(rule, HeadGroups):
                continue
            shapes = {prefix + n: shape for n, shape in rule.shapes(dims).items()}
            for piece in rule.pieces(prefix, FULL, dims, 0, shapes):
                if piece.name.endswith("." + k_name):
                    segments = piece.segments
                    first, last = segments[0], segments[-1]
                    if len(segments) != 1:  # the full layout holds the kv heads in order: one run of rows
                        raise ValueError(f"family {self.name}: {k_name} is not one run of rows of {first.source}")
                    return Segment(first.source, first.dim, first.start, last.stop)
        return None

    def is_ignored(self, name: str) -> bool:
        """Tensors some checkpoints carry that models recompute (e.g. rotary inv_freq)."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.ignored)


REGISTRY: dict[str, Family] = {}
"""model_type -> family; filled by `register` as each family module is imported."""
VARIANT_PREFIXES: set[str] = set()
"""Layer prefixes of the variants (`Family.variant`) whose prefix is not their family's."""


def register(family: Family) -> Family:
    """Add a family under each of its model types (a family module calls this on its table)."""
    for model_type in family.model_types:
        if REGISTRY.get(model_type, family) is not family:
            raise ValueError(
                f"model_type {model_type!r} is registered twice ({REGISTRY[model_type].name}, {family.name})"
            )
        REGISTRY[model_type] = family
    return family


_LAYER_RES: list = [0, ()]  # [registry size when built, compiled patterns]


def _layer_patterns() -> tuple[re.Pattern, ...]:
    if _LAYER_RES[0] != len(REGISTRY) + len(VARIANT_PREFIXES) or not _LAYER_RES[1]:
        prefixes = dict.fromkeys(
            [
                LAYER_PREFIX,
                *(f.layer_prefix for f in REGISTRY.values()),
                *sorted(VARIANT_PREFIXES),
            ]
        )
        patterns = []
        for prefix in prefixes:
            head, tail = prefix.split("{i}")
            patterns.append(re.compile("^" + re.escape(head) + r"(\d+)" + re.escape(tail)))
        _LAYER_RES[:] = [len(REGISTRY) + len(VARIANT_PREFIXES), tuple(patterns)]
    return _LAYER_RES[1]


def layer_of(name: str) -> int | None:
    """The layer index in a full tensor or piece name (under any registered family's layer
    prefix), or None."""
    for pattern in _layer_patterns():
        if match := pattern.match(name):
            return int(match.group(1))
    return None
