"""A decoder built from ONE rank's pieces, its blocks configured by the family's table and config.

The parameters of a `StageModel` are named exactly like the NxD piece names that
`Family.rank_pieces(layout, dims, tp, pp)` gives for the rank (`model.embed_tokens.weight`,
`model.layers.37.self_attn.qkv_proj.weight_q`, `model.layers.37.mlp.gate_up_proj.weight`,
`lm_head.weight`, ...), so `model.state_dict()` IS the rank file's content, and loading a rank
means reading its pieces from any checkpoint (`SourceReader.read_piece`) and assigning them.

Attention: each tp rank holds the q heads `Layout.q_heads(r)` and the kv entries
`Layout.kv_entries(r)`, in that order, so local q head i attends with local kv head
i // (local q / local kv) (grouped-query attention inside the rank; `enable_gqa` of SDPA).
RMSNorm, RoPE and the MLP follow transformers' LlamaModel numerics, so that at tp1pp1 the loss is
the Hugging Face model's. Activations are sequence-first, `[seq, batch, hidden]`.

The other families are the same blocks, configured (`ModelSpec`), not copies of the model: module
paths from the family table (`ModuleNames`, `LayerNames`: GPT-NeoX's `gpt_neox.layers.{i}.attention`),
the norm (RMSNorm, Gemma's (1 + w), LayerNorm with bias), per-head q/k norms (Qwen3, Gemma 3),
GPT-NeoX's per-head fused query_key_value and plain MLP, partial rotary, per-layer sliding windows
and rope tables (Gemma's layer types), attention and final-logit soft-capping, the embedding scale,
and how a layer adds its blocks (`ModelSpec.residual`: sequential, parallel, Gemma's sandwich).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.families import Family, family_for
from shardkit.layout import Layout, ModelDims
from shardkit.placements import QKV_NAMES, HeadGroups, Piece, Placement, Replicated, Split

from .errors import TrainerError
from .layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParamHolder,
    RMSNorm,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    copy_to_tp,
)

SUPPORTED = (
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "qwen3_moe",
    "qwen3",
    "gpt_neox",
    "gemma2",
    "gemma3",
    "phi3",
    "dbrx",
)
# why the trainer's blocks cannot express a family (shardkit converts, merges and reshards them all)
UNSUPPORTED_BECAUSE = {
    "bert": "it is an encoder, not a causal LM",
}
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class LayerNames:
    """Where a decoder layer's modules sit (paths inside the layer, as the family's pieces name them)."""

    attn: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    post_attn_norm: str = "post_attention_layernorm"


LAYER_NAMES = {
    "gpt_neox": LayerNames(attn="attention"),
    "dbrx": LayerNames("norm_attn_norm.attn", "ffn", "norm_attn_norm.norm_1", "norm_attn_norm.norm_2"),
}
"""The families whose layers name their modules otherwise than Llama's."""
SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma's, around the MLP


@dataclass(frozen=True)
class ModuleNames:
    """Where the stage's modules sit, from the family's first and final blocks and its layer prefix."""

    embed: str
    layers: str
    norm: str
    head: str

    @classmethod
    def of(cls, family: Family) -> ModuleNames:
        def module(rules: tuple[Placement, ...], kind: type[Split | Replicated]) -> str:
            names = [r.out or r.name for r in rules if isinstance(r, kind) and r.name.endswith(".weight")]
            return names[0].removesuffix(".weight")

        return cls(
            embed=module(family.first, Split),
            layers=family.layer_prefix.removesuffix(".{i}."),
            norm=module(family.final, Replicated),
            head=module(family.final, Split),
        )


@dataclass(frozen=True)
class ModelSpec:
    """What the trainer needs to know about the model: its config, family, dims and the run's layout."""

    config: Mapping[str, Any]
    family: Family
    dims: ModelDims
    layout: Layout

    @classmethod
    def from_config(cls, config: Mapping[str, Any], layout: Layout) -> ModelSpec:
        family = family_for(config)
        if family.name not in SUPPORTED:
            why = UNSUPPORTED_BECAUSE.get(family.name)
            raise TrainerError(
                f"the trainer supports the decoder families ({', '.join(SUPPORTED)}), not {family.name}"
                + (f" ({why})" if why else "")
                + ": convert/merge/reshard still work for it with shardkit"
            )
        dims = ModelDims.from_config(config)
        layout.validate(dims)
        spec = cls(dict(config), family, dims, layout)
        if spec.activation_name not in ACTIVATIONS:
            raise TrainerError(
                f"activation {spec.activation_name!r} is not supported by the trainer (known: {', '.join(ACTIVATIONS)})"
            )
        if spec.section("ffn_config").get("moe_jitter_eps"):
            raise TrainerError(
                "dbrx: moe_jitter_eps (random router input noise) is not supported by the trainer: set it to null"
            )
        if config.get("use_bidirectional_attention"):
            raise TrainerError(
                f"{family.name}: use_bidirectional_attention is not supported by the trainer (causal only)"
            )
        if dims.tie_word_embeddings and spec.names.head != "lm_head":
            raise TrainerError(
                f"{family.name} with tied embeddings: the trainer ties only an lm_head (untie the config)"
            )
        return spec

    @property
    def names(self) -> ModuleNames:
        return ModuleNames.of(self.family)

    @property
    def layer_names(self) -> LayerNames:
        return LAYER_NAMES.get(self.family.name, LayerNames())

    def _layer_has(self, name: str) -> bool:
        """Whether the family's layer table holds the tensor `name` (a name inside a layer)."""
        return any(name in rule.sources(self.dims) for rule in self.family.layer)

    def section(self, key: str) -> Mapping[str, Any]:
        """A nested part of the config (DBRX's `attn_config`, `ffn_config`), {} when absent."""
        value = self.config.get(key)
        return value if isinstance(value, Mapping) else {}

    @property
    def activation_name(self) -> str:
        dbrx_act = self.section("ffn_config").get("ffn_act_fn") or {}
        return str(
            self.config.get("hidden_activation") or self.config.get("hidden_act") or dbrx_act.get("name", "silu")
        )

    @property
    def eps(self) -> float:
        return float(self.config.get("rms_norm_eps", self.config.get("layer_norm_eps", 1e-6)))

    @property
    def gemma(self) -> bool:
        """Gemma's numerics: (1 + w) norms and the embedding scaled by sqrt(hidden)."""
        return self.family.name in ("gemma2", "gemma3")

    def norm(self, size: int, dtype: torch.dtype, device: torch.device | None) -> nn.Module:
        """One of the family's norms over `size` features (its weights are pieces of the rank)."""
        if self.family.name == "gpt_neox":
            return LayerNorm(size, self.eps, True, dtype, device)
        if self.family.name == "dbrx":  # torch's LayerNorm without bias, its default eps
            return LayerNorm(size, 1e-5, False, dtype, device)
        return RMSNorm(size, self.eps, dtype, device, plus_one=self.gemma)

    @property
    def residual(self) -> str:
        """How a layer adds its blocks: "sequential" (Llama), "parallel" (GPT-NeoX's
        use_parallel_residual: attention and MLP of the same input) or "sandwich" (Gemma's norms
        after attention and around the MLP)."""
        if self._layer_has(SANDWICH_NORMS[0] + ".weight"):
            return "sandwich"
        if self.family.name == "gpt_neox" and self.config.get("use_parallel_residual", True):
            return "parallel"
        return "sequential"

    @property
    def qk_norms(self) -> bool:
        """Per-head RMSNorms of q and k before RoPE (Qwen3, Qwen3-MoE, Gemma 3)."""
        return self._layer_has(f"{self.layer_names.attn}.q_norm.weight")

    @property
    def attention_scaling(self) -> float:
        scalar = self.config.get("query_pre_attn_scalar")
        return float(scalar) ** -0.5 if scalar else self.dims.head_dim**-0.5

    def softcap(self, key: str) -> float | None:
        """Gemma 2's `attn_logit_softcapping` / `final_logit_softcapping` (None: no capping)."""
        value = self.config.get(key)
        return float(value) if value else None

    def hf_config(self) -> Any:
        """transformers' config object of the config (its normalised rope parameters and layer types)."""
        cached = self.__dict__.get("_hf_config")
        if cached is None:
            from transformers import AutoConfig

            cfg = dict(self.config)
            cached = AutoConfig.for_model(
                cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"}
            )
            object.__setattr__(self, "_hf_config", cached)
        return cached

    def layer_types(self) -> list[str] | None:
        """transformers' layer types ("sliding_attention" / "full_attention") of a config with a
        sliding window; None when every layer is alike (no window, or the window on every layer)."""
        if not self.config.get("sliding_window"):
            return None
        return getattr(self.hf_config(), "layer_types", None)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (keys at most window - 1 positions back), as transformers
        masks it: the window on the layers typed "sliding_attention", or on all when there are no types."""
        window = self.config.get("sliding_window")
        types = self.layer_types()
        if not window or (types is not None and types[layer] != "sliding_attention"):
            return None
        return int(window)

    def rope_key(self, layer: int) -> str | None:
        """The rope table layer `layer` uses: its layer type when the rope parameters differ per
        type (Gemma 3's local base for sliding layers), else None (one table)."""
        types = self.layer_types()
        if types is None:
            return None
        per_type = self.hf_config().rope_parameters
        return types[layer] if isinstance(per_type, Mapping) and types[layer] in per_type else None

    def layer_piece_order(self) -> list[str]:
        """The piece names inside a decoder layer (without its prefix), in the rank file's order."""
        prefix = self.family.layer_prefix.format(i=0)
        pieces = self.family.block_pieces("layer", self.layout, self.dims, 0, self.full_shapes)
        return [p.name.removeprefix(prefix) for p in pieces]

    @property
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.family.full_shapes(self.dims)

    def rank_pieces(self, tp_rank: int, pp_rank: int) -> list[Piece]:
        return self.family.rank_pieces(self.layout, self.dims, tp_rank, pp_rank, self.full_shapes)

    def replicated_names(self, pp_rank: int) -> set[str]:
        """Piece names of this stage whose placement is Replicated (norms, row-parallel biases): every
        tp rank computes with the whole tensor, so their gradients are complete on every tp rank
        (partial with sequence parallelism)."""
        names: set[str] = set()
        stage = self.layout.stage_layers(self.dims.num_layers)[pp_rank]
        blocks = []
        if pp_rank == 0:
            blocks.append((self.family.first, ""))
        blocks += [(self.family.layer, self.family.layer_prefix.format(i=i)) for i in stage]
        if pp_rank == self.layout.pp - 1:
            blocks.append((self.family.final, ""))
        for rules, prefix in blocks:
            for rule in rules:
                if isinstance(rule, Replicated):
                    names.update(prefix + (rule.out or n) for n in rule.sources(self.dims))
        return names

    def head_groups(self) -> HeadGroups:
        """The family's attention placement (which biases exist, how heads are cut)."""
        rules = [r for r in self.family.layer if isinstance(r, HeadGroups)]
        if len(rules) != 1:
            raise TrainerError(f"the {self.family.name} family has no single attention placement")
        return rules[0]

    def tied_alias(self, pp_rank: int) -> bool:
        """lm_head is the embedding's Parameter on this rank (tied config, both on one stage)."""
        return self.dims.tie_word_embeddings and pp_rank == 0 and self.layout.pp == 1

    def rope_parameters(self, key: str | None = None) -> tuple[str, float]:
        """(rope type, theta) of the config, or of the layer type `key`'s rope parameters."""
        if key is not None:
            rp = self.hf_config().rope_parameters[key]
            return rp.get("rope_type", "default"), float(rp["rope_theta"])
        rp = self.config.get("rope_parameters") or {}
        scaling = self.config.get("rope_scaling") or {}
        rope_type = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        default = self.config.get(
            "rope_theta", self.config.get("rotary_emb_base", self.section("attn_config").get("rope_theta", 10000.0))
        )
        theta = float(rp.get("rope_theta", default))
        return rope_type, theta


# ---- rotary embedding --------------------------------------------------------------------------------


class Rotary:
    """cos/sin tables as transformers computes them (fp32, then cast to the activation dtype), over
    the rotary share of each head (GPT-NeoX's rotary_pct, Phi's partial_rotary_factor); `key`: a
    layer type with rope parameters of its own (Gemma 3's sliding layers)."""

    def __init__(self, spec: ModelSpec, device: torch.device, key: str | None = None):
        d = int(spec.dims.head_dim * spec.dims.rotary_pct)
        rope_type, theta = spec.rope_parameters(key)
        self.long: tuple[int, torch.Tensor] | None = None  # longrope: (original length, long-factor inv_freq)
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
            self.scaling = 1.0
        else:  # llama3, linear, yarn, longrope, ...: transformers' own initialisers, from the same config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            cfg = spec.hf_config()
            params = cfg.rope_parameters[key] if key else cfg.rope_parameters
            init = partial(
                ROPE_INIT_FUNCTIONS[params["rope_type"]], cfg, device, **({"layer_type": key} if key else {})
            )
            inv_freq, self.scaling = init()
            if params["rope_type"] == "longrope":  # transformers switches to the long factors past this length
                original = int(params["original_max_position_embeddings"])
                self.long = (original, init(seq_len=original + 1)[0].to(device=device, dtype=torch.float))
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float)
        self._cache: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq, dtype)
        if key not in self._cache:
            inv_freq = self.long[1] if self.long is not None and seq > self.long[0] else self.inv_freq
            positions = torch.arange(seq, device=inv_freq.device).float()
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.scaling).to(dtype)[None, None]  # [1, 1, seq, d]
            sin = (emb.sin() * self.scaling).to(dtype)[None, None]
            self._cache[key] = (cos, sin)
        return self._cache[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] features of each head (all of them but with partial rotary)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def causal_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[seq, seq] bool, True where query i may attend key j: j <= i, and i - j < window with a window."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    keep = j <= i
    return keep & (j > i - window) if window is not None else keep


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, softcap: float, keep: torch.Tensor
) -> torch.Tensor:
    """transformers' eager attention with logit soft-capping (Gemma 2): scores capped by
    tanh(s / cap) * cap, then masked, softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


# ---- blocks --------------------------------------------------------------------------------------------


def _module_param(name: str) -> tuple[str, str]:
    """("qkv_proj", "weight_q") of "qkv_proj.weight_q": the holder module and its parameter."""
    module, param = name.split(".")
    return module, param


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` at the dotted `path` under `root`, making the containers on the way."""
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, _Body())
        root = root.get_submodule(part)
    setattr(root, name, module)


class Attention(nn.Module):
    """Local q heads and kv entries of one tp rank; q/k/v parameters named per the qkv style (or, for
    GPT-NeoX, one column-parallel `query_key_value` whose rows are per head [q_h; k_h; v_h]). The
    family's and config's variants: per-head q/k norms, partial rotary, the scaling, logit
    soft-capping and a sliding window."""

    lora: Any = None  # trainer.lora.ColumnLora: adapters on q/k/v (held outside the module's state)
    o_proj: RowParallelLinear  # the output projection under its usual name (GPT-NeoX's is `dense`)

    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None, layer: int = 0):
        super().__init__()
        dims, layout = spec.dims, spec.layout
        d = dims.head_dim
        self.ctx = ctx
        self.head_dim = d
        self.n_q = dims.num_heads // layout.tp
        self.n_kv = dims.num_kv_heads * layout.kv_multiplier // layout.tp
        self.scaling = spec.attention_scaling
        self.softcap = spec.softcap("attn_logit_softcapping")
        self.window = spec.window(layer)
        clip = spec.section("attn_config").get("clip_qkv")
        self.clip = float(clip) if clip else None  # DBRX: q, k and v clamped to [-clip, clip]
        q_rows, kv_rows = self.n_q * d, self.n_kv * d
        self.rows = (q_rows, kv_rows, kv_rows)
        self.per_head_qkv = spec.family.name == "gpt_neox"
        if self.per_head_qkv:
            self.query_key_value = ColumnParallelLinear(dims.hidden_size, sum(self.rows), True, ctx, dtype, device)
            self.weight_refs = [("query_key_value", "weight")]
            self.bias_refs: list[tuple[str, str]] | None = [("query_key_value", "bias")]
            self.o_name, o_bias = "dense", True
        else:
            weight_names, bias_names = QKV_NAMES[layout.qkv]
            heads = spec.head_groups()
            qkv_bias, o_bias = bool(heads.qkv_bias(dims)), bool(heads.o_bias(dims))
            shapes: dict[str, dict[str, tuple[int, ...]]] = {}

            def add(names, row_sizes, trailing):
                if len(names) == 1:
                    row_sizes = [sum(row_sizes)]
                for name, rows in zip(names, row_sizes):
                    module, param = name.split(".")
                    shapes.setdefault(module, {})[param] = (rows, *trailing)

            add(weight_names, self.rows, (dims.hidden_size,))
            if qkv_bias:
                add(bias_names, self.rows, ())
            for module, params in shapes.items():
                self.add_module(module, ParamHolder(params, dtype, device))
            self.weight_refs = [_module_param(n) for n in weight_names]
            self.bias_refs = [_module_param(n) for n in bias_names] if qkv_bias else None
            self.o_name = heads.o_out or heads.o
        self.add_module(self.o_name, RowParallelLinear(q_rows, dims.hidden_size, o_bias, ctx, dtype, device))
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if spec.qk_norms:
            self.q_norm = spec.norm(d, dtype, device)
            self.k_norm = spec.norm(d, dtype, device)

    def _param(self, ref: tuple[str, str]) -> torch.Tensor:
        return getattr(getattr(self, ref[0]), ref[1])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the (sequence-parallel: local chunk of the) input, column-parallel."""
        weights = [self._param(r) for r in self.weight_refs]
        biases: list[torch.Tensor | None] = (
            [self._param(r) for r in self.bias_refs] if self.bias_refs else [None] * len(weights)
        )
        outs: tuple[torch.Tensor, ...] = (self.lora or self.ctx).column_linear(x, weights, biases)
        if len(outs) == 3:
            return outs
        return tuple(outs[0].split(list(self.rows), dim=-1))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [seq, batch, heads, head_dim], q and k normalised per head when the family does."""
        d = self.head_dim
        if self.per_head_qkv:
            (qkv,) = (self.lora or self.ctx).column_linear(
                x, [self._param(r) for r in self.weight_refs], [self._param(r) for r in self.bias_refs or []]
            )
            q, k, v = qkv.view(*qkv.shape[:2], self.n_q, 3 * d).chunk(3, dim=-1)
        else:
            q, k, v = (t.view(*t.shape[:2], -1, d) for t in self.project(x))
        if self.clip is not None:
            q, k, v = (t.clamp(min=-self.clip, max=self.clip) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k)
        return q, k, v

    def _norm_heads(self, norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
        """A per-head norm of this rank's heads: its weight's gradient is a partial sum over the tp
        ranks' heads, summed in backward (f); with sequence parallelism the optimizer sums it, as it
        does every replicated weight's."""
        weight = cast(torch.Tensor, norm.weight)
        if not self.ctx.sequence_parallel:
            weight = copy_to_tp(weight, self.ctx.group)
        return norm(t, weight)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of [batch, heads, seq, d] tensors, local q head i with kv head i // groups."""
        seq = q.shape[2]
        window = self.window if self.window is not None and seq > self.window else None
        if self.softcap is not None:
            return eager_attention(q, k, v, self.scaling, self.softcap, causal_mask(seq, window, q.device))
        mask = causal_mask(seq, window, q.device) if window is not None else None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scaling, enable_gqa=self.n_q != self.n_kv
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        seq, batch = q.shape[0], q.shape[1]
        # [seq, batch, heads, d] -> [batch, heads, seq, d], contiguous: SDPA and RoPE run as fast as
        # on transformers' batch-first tensors (strided inputs cost ~10% of the attention block)
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(seq, batch, self.n_q * self.head_dim)
        return getattr(self, self.o_name)(out)


class MLP(nn.Module):
    """gate_up column-parallel ([gate_r; up_r], NxD's fused layout), down row-parallel."""

    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None):
        super().__init__()
        dims = spec.dims
        self.inter_local = dims.intermediate_size // spec.layout.tp
        self.act = ACTIVATIONS[spec.activation_name]
        self.gate_up_proj = ColumnParallelLinear(
            dims.hidden_size, 2 * self.inter_local, dims.mlp_bias, ctx, dtype, device
        )
        self.down_proj = RowParallelLinear(self.inter_local, dims.hidden_size, dims.mlp_bias, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter_local, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """GPT-NeoX's MLP: dense_h_to_4h column-parallel, the activation, dense_4h_to_h row-parallel (with biases)."""

    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None):
        super().__init__()
        dims = spec.dims
        inter_local = dims.intermediate_size // spec.layout.tp
        self.act = ACTIVATIONS[spec.activation_name]
        self.dense_h_to_4h = ColumnParallelLinear(dims.hidden_size, inter_local, True, ctx, dtype, device)
        self.dense_4h_to_h = RowParallelLinear(inter_local, dims.hidden_size, True, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class DecoderLayer(nn.Module):
    """One decoder layer, its modules where the family's pieces name them, its blocks added as the
    family does (`ModelSpec.residual`)."""

    self_attn: Attention  # where Llama's tree holds them (what LoRA adapts)
    mlp: MLP

    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None, layer: int = 0):
        super().__init__()
        H = spec.dims.hidden_size
        self.names = names = spec.layer_names
        self.residual = spec.residual
        self.rope_key = spec.rope_key(layer)
        mlp = PlainMLP if spec.family.name == "gpt_neox" else MLP
        parts: dict[str, nn.Module] = {
            names.attn: Attention(spec, ctx, dtype, device, layer),
            names.mlp: mlp(spec, ctx, dtype, device),
            names.input_norm: spec.norm(H, dtype, device),
            names.post_attn_norm: spec.norm(H, dtype, device),
        }
        if self.residual == "sandwich":
            parts.update({name: spec.norm(H, dtype, device) for name in SANDWICH_NORMS})
        order = spec.layer_piece_order()

        def position(path: str) -> int:  # registered in the rank file's order, so state_dict() lists it so
            return next((i for i, n in enumerate(order) if n.startswith(path + ".")), len(order))

        for path in sorted(parts, key=position):
            _place(self, path, parts[path])

    def replace_mlp(self, mlp: nn.Module) -> None:
        """Put `mlp` (a MoE block) where the layer's MLP sits."""
        _place(self, self.names.mlp, mlp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        part, names = self.get_submodule, self.names
        attn, mlp = part(names.attn), part(names.mlp)
        norm_in, norm_post = part(names.input_norm), part(names.post_attn_norm)
        if self.residual == "parallel":
            return mlp(norm_post(x)) + attn(norm_in(x), cos, sin) + x
        if self.residual == "sandwich":
            pre_ff, post_ff = (part(n) for n in SANDWICH_NORMS)
            h = x + norm_post(attn(norm_in(x), cos, sin))
            return h + post_ff(mlp(pre_ff(h)))
        h = x + attn(norm_in(x), cos, sin)
        return h + mlp(norm_post(h))


class _Body(nn.Module):
    """A container of the stage's modules (`model.` of Llama's piece names: embed_tokens on the first
    stage, the layers, norm on the last)."""

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleDict
    norm: RMSNorm


class StageModel(nn.Module):
    """The part of the model one (tp, pp) rank runs. First stage: token ids [batch, seq] in;
    middle stages: hidden [seq(/tp), batch, hidden] in and out; last stage: local logits
    [seq, batch, vocab/tp] out. Its modules sit where the family's pieces name them
    (`ModuleNames`: `model.layers` for Llama, `gpt_neox.layers` for GPT-NeoX, ...)."""

    model: _Body  # the families with Llama's module tree
    lm_head: ColumnParallelLinear

    def __init__(
        self,
        spec: ModelSpec,
        ctx: TPContext,
        pp_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        activation_checkpointing: bool = False,
        checkpoint_fn: Callable[..., Any] | None = None,
    ):
        super().__init__()
        dims, layout = spec.dims, spec.layout
        self.spec = spec
        self.names = names = spec.names
        # the communication backend's activation checkpointing (torch-xla's on XLA)
        self.checkpoint_fn = checkpoint_fn or _torch_checkpoint
        self.ctx = ctx
        self.first = pp_rank == 0
        self.last = pp_rank == layout.pp - 1
        self.activation_checkpointing = activation_checkpointing
        meta = torch.device("meta")
        if self.first:
            pad = spec.config.get("pad_token_id") if spec.family.name != "gpt_neox" else None  # NeoX: no padding_idx
            _place(
                self,
                names.embed,
                VocabParallelEmbedding(
                    dims.vocab_size // layout.tp,
                    dims.hidden_size,
                    ctx,
                    dtype,
                    pad if isinstance(pad, int) else None,
                    meta,
                ),
            )
        self.embed_scale = dims.hidden_size**0.5 if spec.gemma else None
        self.layer_ids = list(layout.stage_layers(dims.num_layers)[pp_rank])
        layers = nn.ModuleDict({str(i): DecoderLayer(spec, ctx, dtype, meta, i) for i in self.layer_ids})
        _place(self, names.layers, layers)
        if self.last:
            _place(self, names.norm, spec.norm(dims.hidden_size, dtype, meta))
            _place(
                self,
                names.head,
                ColumnParallelLinear(dims.hidden_size, dims.vocab_size // layout.tp, False, ctx, dtype, meta),
            )
        self.final_softcap = spec.softcap("final_logit_softcapping")
        self.tied = spec.tied_alias(pp_rank)
        keys = dict.fromkeys(spec.rope_key(i) for i in range(dims.num_layers))
        self.rotaries = {key: Rotary(spec, device, key) for key in keys}
        self.rotary = next(iter(self.rotaries.values()))

    @property
    def layers(self) -> nn.ModuleDict:
        return self.get_submodule(self.names.layers)  # type: ignore[return-value]

    @property
    def embedding(self) -> VocabParallelEmbedding:
        return self.get_submodule(self.names.embed)  # type: ignore[return-value]

    @property
    def final_norm(self) -> nn.Module:
        return self.get_submodule(self.names.norm)

    @property
    def head(self) -> ColumnParallelLinear:
        return self.get_submodule(self.names.head)  # type: ignore[return-value]

    def load_pieces(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the rank's pieces as parameters (names and shapes must match exactly)."""
        expected = {k: tuple(v.shape) for k, v in self.state_dict(keep_vars=True).items()}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if expected != got:
            missing = sorted(set(expected) - set(got))
            extra = sorted(set(got) - set(expected))
            wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
            what = (
                f"lacks {missing[0]}"
                if missing
                else f"has unexpected {extra[0]}"
                if extra
                else f"{wrong[0]} has shape {got[wrong[0]]}, the model expects {expected[wrong[0]]}"
            )
            raise TrainerError(f"the rank's pieces do not fit the model: {what}")
        dtype = next(iter(self.state_dict(keep_vars=True).values())).dtype
        self.load_state_dict({k: v.to(dtype).contiguous() for k, v in tensors.items()}, assign=True)
        if self.tied:
            self.head.weight = self.embedding.weight
        for p in self.parameters():
            p.requires_grad_(True)

    def seq_len_of(self, x: torch.Tensor, first: bool | None = None) -> int:
        if self.first if first is None else first:
            return x.shape[1]
        return x.shape[0] * (self.ctx.group.size if self.ctx.sequence_parallel else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_layers(x, self.layers.values(), self.first, self.last)

    def run_chunk(self, x: torch.Tensor, layers: Iterable[nn.Module], first: bool, last: bool, *carried: torch.Tensor):
        """A pipeline stage's forward over `layers` (a MoE model also takes and returns the statistics
        carried beside the hidden states)."""
        return self.run_layers(x, layers, first, last)

    def run_layers(self, x: torch.Tensor, layers: Iterable[nn.Module], first: bool, last: bool) -> torch.Tensor:
        """Run `layers` of this rank (all of them, or one virtual-pipeline chunk's): from token ids
        through the embedding when `first`, to local logits through the final norm and head when `last`."""
        seq = self.seq_len_of(x, first)
        if first:
            h = self.embedding(x.t())
            if self.embed_scale is not None:  # Gemma: sqrt(hidden) in the activations' dtype, as transformers casts it
                h = h * torch.tensor(self.embed_scale).to(h.dtype)
        else:
            h = x
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in layers:
            key = cast(DecoderLayer, layer).rope_key
            if key not in tables:
                tables[key] = self.rotaries[key](seq, h.dtype)
            h = self.run_layer(layer, h, *tables[key])
        if not last:
            return h
        logits = self.head(self.final_norm(h))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def run_layer(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One decoder layer (recomputed in backward with activation checkpointing)."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return self.checkpoint_fn(layer, h, cos, sin)
        return layer(h, cos, sin)


def _torch_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False)


def param_count(spec: ModelSpec) -> int:
    return sum(math.prod(s) for s in spec.full_shapes.values())
