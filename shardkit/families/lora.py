"""LoRA adapters as a model family of their own, derived from the family of the model they adapt.

A targeted linear layer y = x W^T gets y = x W^T + (alpha / r) (x A^T) B^T with A (r, in) and B
(out, r), as peft computes it. Under tensor parallelism each adapter is cut like its base weight:
on a column-parallel weight (q, k, v, gate, up) B is split on its output rows exactly as W's rows
are (the same head segments, kv replicas, fused qkv or gate_up) and A is replicated; on a
row-parallel weight (o, down) A is split on its input columns as W's and B is replicated.

Why a family: the layout algebra then places, saves, reshards and gathers adapters like any
weights. The trainer writes adapter-only checkpoints whose config.json is the base model's with a
`trainer_lora` section (rank, alpha, targets, the base model's type and where it came from) and a
`model_type` naming the adapters; `family_for` sees that section and builds the family here, so
the trainer and every shardkit command (`ckpt inspect/export/reshard`) use this one definition.
Unlike the other family modules this one registers nothing at import: its tables depend on the
checkpoint's settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ConfigMismatchError, UnsupportedModelError
from ..layout import Layout, ModelDims
from ..placements import Piece, Placement, Replicated, Segment, make_piece
from .base import REGISTRY, Family, Shapes, register

# the targets' short names -> the module inside a decoder layer (peft's target_modules: the last part)
TARGETS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
LORA_KEY = "trainer_lora"
"""The adapters' section in an adapter checkpoint's config.json (the trainer's name for it)."""


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of a run: rank, alpha and the targeted modules (in TARGETS order).

    `base_model` (where the frozen weights came from) is recorded for `ckpt export --merged` and
    peft's `base_model_name_or_path`; it is not part of what makes two runs' adapters the same."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_model: str | None = field(default=None, compare=False)

    @property
    def scale(self) -> float:
        """peft's scaling: lora_alpha / r."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}
        if self.base_model is not None:
            out["base_model"] = self.base_model
        return out

    def describe(self) -> str:
        return f"rank {self.rank}, alpha {self.alpha:g}, targets {','.join(self.targets)}"


def saved_settings(config: Mapping[str, Any] | None) -> LoraSettings | None:
    """The LoRA settings a checkpoint's config records (None: a checkpoint of full weights), or a
    ConfigMismatchError when its section is malformed."""
    section = (config or {}).get(LORA_KEY)
    if section is None:
        return None
    try:
        assert isinstance(section, Mapping)
        rank, alpha, targets = int(section["rank"]), float(section["alpha"]), tuple(section["targets"])
        base = section.get("base_model")
        assert rank > 0 and alpha > 0 and targets and all(t in TARGETS for t in targets)
        assert base is None or isinstance(base, str)
    except (AssertionError, KeyError, TypeError, ValueError):
        raise ConfigMismatchError(
            f"the config's {LORA_KEY!r} section is malformed (it needs rank, alpha and targets among "
            f"{','.join(TARGETS)}): the adapter checkpoint's config.json is damaged"
        ) from None
    return LoraSettings(rank, alpha, tuple(t for t in TARGETS if t in targets), base)


def base_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The base model's config inside an adapter checkpoint's config (the config itself otherwise)."""
    section = config.get(LORA_KEY)
    if not isinstance(section, Mapping):
        return dict(config)
    out = {k: v for k, v in config.items() if k != LORA_KEY}
    out["model_type"] = section.get("base_model_type")
    return out


def model_type_of(base: Family, settings: LoraSettings) -> str:
    """The model_type of `base`'s adapters of `settings` (what the adapter checkpoint records)."""
    return f"{LORA_KEY}_{base.name}_r{settings.rank}_{'_'.join(settings.targets)}"


def adapter_config(config: Mapping[str, Any], base: Family, settings: LoraSettings) -> dict[str, Any]:
    """An adapter checkpoint's config: the base model's config (`config`), the adapters'
    model_type and the LORA_KEY section."""
    dims = ModelDims.from_config(config)
    out = dict(config)
    out["model_type"] = model_type_of(base, settings)
    out["tie_word_embeddings"] = dims.tie_word_embeddings
    out[LORA_KEY] = {**settings.to_dict(), "base_model_type": dims.model_type}
    return out


@dataclass(frozen=True)
class AdapterSplit:
    """An adapter matrix split over tp like its base weight: the segments of `source` in the base
    placement's pieces, re-pointed at the adapter tensor `name` (B of a column-parallel weight,
    dim 0; A of a row-parallel one, dim 1)."""

    expert: ClassVar[bool] = False
    base: Placement
    source: str  # the base weight, inside a layer ("self_attn.q_proj.weight")
    name: str  # the adapter tensor ("self_attn.q_proj.lora_B.weight")
    dim: int
    rank: int

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        out, inn = self.base.shapes(dims)[self.source]
        return {self.name: (out, self.rank) if self.dim == 0 else (self.rank, inn)}

    def sources(self, dims: ModelDims) -> list[str]:
        return [self.name]

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {self.name: self.dim}

    def pieces(
        self, prefix: str, layout: Layout, dims: ModelDims, tp_rank: int, full_shapes: Shapes, ep_rank: int = 0
    ) -> list[Piece]:
        base_shapes = {prefix + n: s for n, s in self.base.shapes(dims).items()}
        segments = [
            Segment(prefix + self.name, s.dim, s.start, s.stop)
            for piece in self.base.pieces(prefix, layout, dims, tp_rank, base_shapes)
            for s in piece.segments
            if s.source == prefix + self.source
        ]
        return [make_piece(prefix + self.name, segments, full_shapes)]


def _feature(base: Placement, source: str, axis: int) -> Callable[[ModelDims], int]:
    return lambda dims: base.shapes(dims)[source][axis]


def lora_family(base: Family, dims: ModelDims, settings: LoraSettings) -> Family:
    """The adapters of `settings` on `base`'s layers as a registered family (A then B per target);
    UnsupportedModelError when `base` has no such linear layer (a MoE model's experts, say)."""
    model_type = model_type_of(base, settings)
    known = REGISTRY.get(model_type)
    if known is not None:
        return known
    rules: list[Placement] = []
    for target in settings.targets:
        module = TARGETS[target]
        source = module + ".weight"
        owner = next((r for r in base.layer if source in r.sources(dims)), None)
        if owner is None:
            raise UnsupportedModelError(
                f"LoRA target {target}: the {base.name} family has no {source} to adapt; choose among the "
                "linear layers it has"
            )
        a, b = module + ".lora_A.weight", module + ".lora_B.weight"
        if owner.split_dims(dims)[source] == 0:  # column-parallel: B split like W's rows, A replicated
            rules += [
                Replicated(a, (settings.rank, _feature(owner, source, 1))),
                AdapterSplit(owner, source, b, 0, settings.rank),
            ]
        else:  # row-parallel: A split like W's columns, B replicated
            rules += [
                AdapterSplit(owner, source, a, 1, settings.rank),
                Replicated(b, (_feature(owner, source, 0), settings.rank)),
            ]
    family = Family(
        name=LORA_KEY, model_types=(model_type,), first=(), layer=tuple(rules), final=(), layer_prefix=base.layer_prefix
    )
    return register(family)


def adapter_family(base: Family, config: Mapping[str, Any]) -> Family:
    """The family of an adapter checkpoint whose config is `config` (it has a LORA_KEY section),
    given the family of its base model (`family_for` of `base_config(config)`)."""
    settings = saved_settings(config)
    assert settings is not None, "adapter_family needs a config with a LoRA section"
    return lora_family(base, ModelDims.from_config(base_config(config)), settings)


def adapted_weights(family: Family, settings: LoraSettings, num_layers: int) -> dict[str, str]:
    """Every weight the adapters of `family` (an adapter family) change: its full name -> its
    module's full name (whose `.lora_A.weight` / `.lora_B.weight` are the adapters)."""
    out = {}
    for i in range(num_layers):
        for target in settings.targets:
            module = family.layer_prefix.format(i=i) + TARGETS[target]
            out[module + ".weight"] = module
    return out
