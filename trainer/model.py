"""A Llama-family decoder built from ONE rank's pieces.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.families import Family, family_for
from shardkit.layout import Layout, ModelDims
from shardkit.placements import QKV_NAMES, HeadGroups, Piece, Replicated

from .errors import TrainerError
from .layers import ColumnParallelLinear, ParamHolder, RMSNorm, RowParallelLinear, TPContext, VocabParallelEmbedding

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")  # MoE layers: trainer/moe.py
# why the trainer's blocks cannot express a family (shardkit converts, merges and reshards them all)
UNSUPPORTED_BECAUSE = {
    "dbrx": "its attention (clipped fused qkv, LayerNorm) and flat expert layout",
    "qwen3": "per-head q/k norms",
    "gemma3": "per-head q/k norms and Gemma's norms",
    "gemma2": "Gemma's (1 + w) norms, extra feed-forward norms, embedding scaling and soft-capping",
    "phi3": "Phi-3's rope variants (longrope) are not implemented",
    "gpt_neox": "LayerNorm, partial rotary and the parallel residual",
    "bert": "it is an encoder, not a causal LM",
}
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


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
        act = str(config.get("hidden_act", "silu"))
        if act not in ACTIVATIONS:
            raise TrainerError(f"activation {act!r} is not supported by the trainer (known: {', '.join(ACTIVATIONS)})")
        return cls(dict(config), family, dims, layout)

    @property
    def eps(self) -> float:
        return float(self.config.get("rms_norm_eps", 1e-6))

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
        blocks += [(self.family.layer, f"model.layers.{i}.") for i in stage]
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

    def rope_parameters(self) -> tuple[str, float]:
        rp = self.config.get("rope_parameters") or {}
        scaling = self.config.get("rope_scaling") or {}
        rope_type = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        theta = float(rp.get("rope_theta", self.config.get("rope_theta", 10000.0)))
        return rope_type, theta

    def check_sequence(self, seq_len: int) -> None:
        window = self.config.get("sliding_window")
        uses_window = self.family.name == "mistral" or bool(self.config.get("use_sliding_window", False))
        if uses_window and window and seq_len > int(window):
            raise TrainerError(
                f"--seq-len {seq_len} exceeds the model's sliding window of {window}: sliding-window attention "
                f"is not implemented in the trainer; use --seq-len <= {window}"
            )


# ---- rotary embedding --------------------------------------------------------------------------------


class Rotary:
    """cos/sin tables as transformers computes them (fp32, then cast to the activation dtype)."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        d = spec.dims.head_dim
        rope_type, theta = spec.rope_parameters()
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
            self.scaling = 1.0
        else:  # llama3, linear, yarn, ...: transformers' own initialisers, from the same config
            from transformers import AutoConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            cfg = dict(spec.config)
            cfg_obj = AutoConfig.for_model(
                cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"}
            )
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg_obj, device)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float)
        self._cache: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq, dtype)
        if key not in self._cache:
            positions = torch.arange(seq, device=self.inv_freq.device).float()
            freqs = positions[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.scaling).to(dtype)[None, None]  # [1, 1, seq, d]
            sin = (emb.sin() * self.scaling).to(dtype)[None, None]
            self._cache[key] = (cos, sin)
        return self._cache[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


# ---- blocks --------------------------------------------------------------------------------------------


def _module_param(name: str) -> tuple[str, str]:
    """("qkv_proj", "weight_q") of "qkv_proj.weight_q": the holder module and its parameter."""
    module, param = name.split(".")
    return module, param


class Attention(nn.Module):
    """Local q heads and kv entries of one tp rank; q/k/v parameters named per the qkv style."""

    lora: Any = None  # trainer.lora.ColumnLora: adapters on q/k/v (held outside the module's state)

    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None):
        super().__init__()
        dims, layout = spec.dims, spec.layout
        d = dims.head_dim
        self.ctx = ctx
        self.head_dim = d
        self.n_q = dims.num_heads // layout.tp
        self.n_kv = dims.num_kv_heads * layout.kv_multiplier // layout.tp
        self.scaling = d**-0.5
        q_rows, kv_rows = self.n_q * d, self.n_kv * d
        self.rows = (q_rows, kv_rows, kv_rows)
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
        self.o_proj = RowParallelLinear(q_rows, dims.hidden_size, o_bias, ctx, dtype, device)

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        seq, batch = q.shape[0], q.shape[1]
        # [seq, batch, heads * d] -> [batch, heads, seq, d], contiguous: SDPA and RoPE run as fast as
        # on transformers' batch-first tensors (strided inputs cost ~10% of the attention block)
        q, k, v = (t.view(seq, batch, -1, self.head_dim).permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.n_q != self.n_kv
        )
        out = out.permute(2, 0, 1, 3).reshape(seq, batch, self.n_q * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """gate_up column-parallel ([gate_r; up_r], NxD's fused layout), down row-parallel."""

    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None):
        super().__init__()
        dims = spec.dims
        self.inter_local = dims.intermediate_size // spec.layout.tp
        self.act = ACTIVATIONS[str(spec.config.get("hidden_act", "silu"))]
        self.gate_up_proj = ColumnParallelLinear(
            dims.hidden_size, 2 * self.inter_local, dims.mlp_bias, ctx, dtype, device
        )
        self.down_proj = RowParallelLinear(self.inter_local, dims.hidden_size, dims.mlp_bias, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter_local, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, ctx: TPContext, dtype, device=None):
        super().__init__()
        H = spec.dims.hidden_size
        self.self_attn = Attention(spec, ctx, dtype, device)
        self.mlp = MLP(spec, ctx, dtype, device)
        self.input_layernorm = RMSNorm(H, spec.eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(H, spec.eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Body(nn.Module):
    """The `model.` part of the piece names; it holds embed_tokens on the first stage and norm on the last."""

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleDict
    norm: RMSNorm


class StageModel(nn.Module):
    """The part of the model one (tp, pp) rank runs. First stage: token ids [batch, seq] in;
    middle stages: hidden [seq(/tp), batch, hidden] in and out; last stage: local logits
    [seq, batch, vocab/tp] out."""

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
        # the communication backend's activation checkpointing (torch-xla's on XLA)
        self.checkpoint_fn = checkpoint_fn or _torch_checkpoint
        self.ctx = ctx
        self.first = pp_rank == 0
        self.last = pp_rank == layout.pp - 1
        self.activation_checkpointing = activation_checkpointing
        meta = torch.device("meta")
        self.model = _Body()
        if self.first:
            pad = spec.config.get("pad_token_id")
            self.model.embed_tokens = VocabParallelEmbedding(
                dims.vocab_size // layout.tp, dims.hidden_size, ctx, dtype, pad if isinstance(pad, int) else None, meta
            )
        self.layer_ids = list(layout.stage_layers(dims.num_layers)[pp_rank])
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(spec, ctx, dtype, meta) for i in self.layer_ids})
        if self.last:
            self.model.norm = RMSNorm(dims.hidden_size, spec.eps, dtype, meta)
            self.lm_head = ColumnParallelLinear(dims.hidden_size, dims.vocab_size // layout.tp, False, ctx, dtype, meta)
        self.tied = spec.tied_alias(pp_rank)
        self.rotary = Rotary(spec, device)

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
            self.lm_head.weight = self.model.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(True)

    def seq_len_of(self, x: torch.Tensor, first: bool | None = None) -> int:
        if self.first if first is None else first:
            return x.shape[1]
        return x.shape[0] * (self.ctx.group.size if self.ctx.sequence_parallel else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_layers(x, self.model.layers.values(), self.first, self.last)

    def run_chunk(self, x: torch.Tensor, layers: Iterable[nn.Module], first: bool, last: bool, *carried: torch.Tensor):
        """A pipeline stage's forward over `layers` (a MoE model also takes and returns the statistics
        carried beside the hidden states)."""
        return self.run_layers(x, layers, first, last)

    def run_layers(self, x: torch.Tensor, layers: Iterable[nn.Module], first: bool, last: bool) -> torch.Tensor:
        """Run `layers` of this rank (all of them, or one virtual-pipeline chunk's): from token ids
        through the embedding when `first`, to local logits through the final norm and head when `last`."""
        seq = self.seq_len_of(x, first)
        if first:
            h = self.model.embed_tokens(x.t())
        else:
            h = x
        cos, sin = self.rotary(seq, h.dtype)
        for layer in layers:
            h = self.run_layer(layer, h, cos, sin)
        if not last:
            return h
        return self.lm_head(self.model.norm(h))

    def run_layer(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One decoder layer (recomputed in backward with activation checkpointing)."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return self.checkpoint_fn(layer, h, cos, sin)
        return layer(h, cos, sin)


def _torch_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False)


def param_count(spec: ModelSpec) -> int:
    return sum(math.prod(s) for s in spec.full_shapes.values())
