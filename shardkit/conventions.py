"""Naming conventions: the names (and row orders) other trainers give a model's tensors.

shardkit works in Hugging Face names. A checkpoint written by another trainer keeps the same
tensors under its own names, and may store some of them with their rows in another order:
torchtitan's Llama 3 (`torchtitan/models/llama3/.../state_dict_adapter.py`) names the embedding
`tok_embeddings.weight`, q `layers.{i}.attention.wq.weight` and so on, and stores q and k with
each head's two rotary halves interleaved (its `_reverse_permute`: a head's rows `[0 .. d/2)` and
`[d/2 .. d)` become rows 0, 2, 4, ... and 1, 3, 5, ...), because its rotary embedding pairs
neighbouring rows where Hugging Face's pairs the two halves. The permutation stays inside each
head, so a slice of whole heads maps onto the same rows in both conventions; Adam's moments,
being elementwise, are permuted exactly like their weights.

torchtitan 0.3's llama3 (every config's default, `fuse_qkv=True`) holds q, k and v as one
parameter, `layers.{i}.attention.qkv_linear.wqkv.weight` (its `FusedQKVLinear`): a state-dict hook
gives the model's tensors apart (`wq`, `wk`, `wv`, as above), but the optimizer keys their state by
the fused parameter. Its rows are grouped per kv head: the group's q heads (heads / kv heads of
them), then its k head, then its v head, each q and k head's rows permuted as above (`Fusion`).

A convention is data: one table of renames per family, the tensors whose heads are permuted and
the parameters that may be fused. `CONVENTIONS` lists them; `names` and `find` answer which one a
set of names follows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .errors import ShardkitError
from .layout import ModelDims

HF = "hf"
TITAN = "torchtitan"
TITAN_03 = "torchtitan-0.3"
TITAN_03_UNFUSED = "torchtitan-0.3-unfused"


@dataclass(frozen=True)
class Fusion:
    """Hugging Face tensors a trainer's module holds as one parameter, `native` (`{i}`: the layer),
    while its state dict gives them apart: q, k and v (`parts`, Hugging Face patterns) in
    torchtitan 0.3's `FusedQKVLinear`, whose rows are, per kv head, its q heads', then its k and
    its v head's rows."""

    native: str
    parts: tuple[str, str, str]

    def blocks(self, layer: str, dims: ModelDims) -> list[tuple[str, int, int]]:
        """The fused tensor's rows in order, as (Hugging Face name, start, stop) row ranges of the parts."""
        q, k, v = (p.replace("{i}", layer) for p in self.parts)
        hd, per = dims.head_dim, dims.num_heads // dims.num_kv_heads
        out = []
        for g in range(dims.num_kv_heads):
            out += [(q, g * per * hd, (g + 1) * per * hd), (k, g * hd, (g + 1) * hd), (v, g * hd, (g + 1) * hd)]
        return out

    def shape(self, dims: ModelDims) -> tuple[int, int]:
        """The fused tensor's shape."""
        return (dims.q_size + 2 * dims.kv_size, dims.hidden_size)


@dataclass(frozen=True)
class Convention:
    """How a trainer names a family's tensors: `renames` maps Hugging Face name patterns
    (`{i}` is the layer index) to its own; `permuted` lists the Hugging Face patterns stored with
    each head's rotary halves interleaved (head size `head_dim`). An empty table keeps the names."""

    name: str
    label: str
    summary: str
    families: tuple[str, ...] = ()
    """The families it names (empty: every family, names kept)."""
    renames: tuple[tuple[str, str], ...] = ()
    permuted: tuple[str, ...] = ()
    unties: bool = True
    """Whether a model with tied embeddings can be written (torchtitan's Llama 3 stores no tie)."""
    fusions: tuple[Fusion, ...] = ()
    """Parameters the trainer may hold fused (read either way: found in the checkpoint)."""
    fused: bool = False
    """Whether a training checkpoint is written with the optimizer's state of `fusions` fused."""
    _to: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    _from: list[tuple[re.Pattern[str], str]] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        for hf, native in self.renames:
            self._to[hf] = native
            self._from.append((_pattern(native), hf))

    def check(self, family: str, dims: ModelDims) -> None:
        """Refuse a model this convention cannot name (one line)."""
        if self.families and family not in self.families:
            raise ShardkitError(
                f"the {self.name} convention names {', '.join(self.families)} models, not {family}: use --convention hf"
            )
        if not self.unties and dims.tie_word_embeddings:
            raise ShardkitError(
                f"the {self.name} convention has no tied embeddings (this config ties them): use --convention hf"
            )

    def native(self, hf_name: str) -> str:
        """The convention's name of a Hugging Face tensor name."""
        if not self.renames:
            return hf_name
        abstract, layer = _abstract(hf_name)
        native = self._to.get(abstract)
        if native is None:
            raise ShardkitError(f"the {self.name} convention has no name for {hf_name}")
        return native.replace("{i}", layer) if layer is not None else native

    def hf(self, native: str) -> str | None:
        """The Hugging Face name of one of the convention's names (None: not a model tensor)."""
        if not self.renames:
            return native
        for pattern, hf in self._from:
            m = pattern.match(native)
            if m:
                return hf.replace("{i}", m.group(1)) if "{i}" in hf else hf
        return None

    def fusion(self, hf_name: str) -> tuple[Fusion, str] | None:
        """The fusion a Hugging Face tensor is part of, and its layer; None when none is."""
        abstract, layer = _abstract(hf_name)
        for fusion in self.fusions:
            if abstract in fusion.parts and layer is not None:
                return fusion, layer
        return None

    def fused_rows(self, hf_name: str, dims: ModelDims) -> tuple[str, list[tuple[int, int]]]:
        """The fused parameter holding a part, and the row ranges of it that are the part's rows, in order."""
        found = self.fusion(hf_name)
        if found is None:
            raise ShardkitError(f"the {self.name} convention fuses no parameter of {hf_name}")
        fusion, layer = found
        rows, at = [], 0
        for name, start, stop in fusion.blocks(layer, dims):
            if name == hf_name:
                rows.append((at, at + stop - start))
            at += stop - start
        return fusion.native.replace("{i}", layer), rows

    def fused_shape(self, hf_name: str, dims: ModelDims) -> tuple[int, ...]:
        """The shape of the fused parameter a part is in."""
        found = self.fusion(hf_name)
        if found is None:
            raise ShardkitError(f"the {self.name} convention fuses no parameter of {hf_name}")
        return found[0].shape(dims)

    def head_dim(self, hf_name: str, dims: ModelDims) -> int | None:
        """The head size whose rotary halves are interleaved in this tensor's rows, or None."""
        abstract, _ = _abstract(hf_name)
        return dims.head_dim if abstract in self.permuted else None


def _abstract(name: str) -> tuple[str, str | None]:
    """A layer's tensor name with its index replaced by `{i}` (and the index)."""
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        return name, None
    return name[: m.start(1)] + "{i}" + name[m.end(1) :], m.group(1)


def _pattern(native: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(native).replace(r"\{i\}", r"(\d+)") + "$")


def _titan(attention: str, output: str) -> tuple[tuple[str, str], ...]:
    layer = "model.layers.{i}."
    return (
        ("model.embed_tokens.weight", "tok_embeddings.weight"),
        (layer + "self_attn.q_proj.weight", f"layers.{{i}}.attention.{attention}wq.weight"),
        (layer + "self_attn.k_proj.weight", f"layers.{{i}}.attention.{attention}wk.weight"),
        (layer + "self_attn.v_proj.weight", f"layers.{{i}}.attention.{attention}wv.weight"),
        (layer + "self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
        (layer + "mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
        (layer + "mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
        (layer + "mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
        (layer + "input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        (layer + "post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        ("model.norm.weight", "norm.weight"),
        ("lm_head.weight", output),
    )


_PERMUTED = ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight")


_QKV = Fusion(
    "layers.{i}.attention.qkv_linear.wqkv.weight",
    (
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
    ),
)


def _titan_convention(
    name: str, version: str, attention: str, output: str, fused: bool | None = None, note: str = ""
) -> Convention:
    """torchtitan's llama3 names of one release line (`attention` before wq/wk/wv, the output's
    name); `fused`: 0.3's fused qkv, written fused (True) or apart (False)."""
    return Convention(
        name,
        f"torchtitan {version} Llama 3" + note,
        f"torchtitan {version} llama3 names (tok_embeddings, layers.{{i}}.attention.{attention}wq, {output}), "
        "q/k heads permuted" + note,
        families=("llama",),
        renames=_titan(attention, output),
        permuted=_PERMUTED,
        unties=False,
        fusions=(_QKV,) if fused is not None else (),
        fused=bool(fused),
    )


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention(HF, "Hugging Face", "transformers' own names (model.layers.{i}.self_attn.q_proj.weight ...)"),
        _titan_convention(TITAN, "0.1-0.2", "", "output.weight"),
        _titan_convention(TITAN_03, "0.3", "qkv_linear.", "lm_head.weight", True),
        _titan_convention(TITAN_03_UNFUSED, "0.3", "qkv_linear.", "lm_head.weight", False, " (fuse_qkv=False)"),
    )
}


def get_convention(name: str | None) -> Convention:
    """The convention called `name` (None: Hugging Face's), or a one-line error listing them."""
    if name is None:
        return CONVENTIONS[HF]
    if name not in CONVENTIONS:
        raise ShardkitError(f"convention {name!r} is unknown: use one of {', '.join(CONVENTIONS)}")
    return CONVENTIONS[name]


def find(names: Iterable[str], wanted: Iterable[str]) -> tuple[Convention, list[str]]:
    """The convention under which `names` (a checkpoint's tensor names) hold every one of `wanted`
    (a model's Hugging Face names), and the missing ones of the closest when none does."""
    present, needed = set(names), list(wanted)
    best: tuple[Convention, list[str]] | None = None
    for convention in CONVENTIONS.values():
        missing = []
        for hf in needed:
            try:
                native = convention.native(hf)
            except ShardkitError:
                native = None
            if native not in present:
                missing.append(hf)
        if not missing:
            return convention, []
        if best is None or len(missing) < len(best[1]):
            best = (convention, missing)
    assert best is not None
    return best


def to_native(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Hugging Face rows of whole heads in the permuted convention's order (torchtitan's
    `_reverse_permute`): each head's halves interleaved."""
    rest = rows.shape[1:]
    return rows.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(rows.shape).contiguous()


def to_hf(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `to_native` (torchtitan's `_permute`)."""
    rest = rows.shape[1:]
    return rows.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows.shape).contiguous()
