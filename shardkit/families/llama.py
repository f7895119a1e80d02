"""Llama (Llama 2/3/3.1/3.2, TinyLlama, Code Llama: model_type "llama").

Embedding and lm_head vocab-parallel; attention by head groups; gate and up fused into NxD's
`mlp.gate_up_proj`; o and down row-parallel; norms replicated. lm_head takes the embedding's
values when the config ties them (Llama 3.2 1B/3B). Rope scaling (Llama 3.1) changes no weights.

The building blocks below are shared by the other decoder families that keep Llama's names.
"""

from typing import Any

from ..layout import ModelDims
from ..placements import Fused, HeadGroups, Placement, Replicated, Split
from .base import Family, register

H, V, I = "hidden_size", "vocab_size", "intermediate_size"


def _mlp_bias(dims: ModelDims) -> bool:
    return dims.mlp_bias


def norms(*names: str, bias: bool = False) -> tuple[Replicated, ...]:
    """Replicated (hidden,) norm weights (and biases, for LayerNorms that have them)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return tuple(Replicated(f"{n}.{k}", (H,)) for n in names for k in kinds)


EMBEDDING = (Split("model.embed_tokens.weight", 0, (V, H)),)
NORMS = norms("input_layernorm", "post_attention_layernorm")
HEAD = (Replicated("model.norm.weight", (H,)), Split("lm_head.weight", 0, (V, H), tied_to="model.embed_tokens.weight"))
GATED_MLP = (
    Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0, (I, H)),
    Fused("mlp.gate_up_proj.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), 0, (I,), when=_mlp_bias),
    Split("mlp.down_proj.weight", 1, (H, I)),
    Replicated("mlp.down_proj.bias", (H,), when=_mlp_bias),
)


def llama_like(name: str, *layer: Placement, model_type: str | None = None, **fields: Any) -> Family:
    """Register a decoder family that keeps Llama's names around its layers (embedding, final
    norm, head) with `layer` as each decoder layer's table (`fields`: Family's other fields)."""
    family = Family(
        name=name,
        model_types=(model_type or name,),
        first=EMBEDDING,
        layer=layer,
        final=HEAD,
        ignored=("*.rotary_emb.inv_freq",),
        **fields,
    )
    return register(family)


def router(name: str) -> Replicated:
    """A mixture-of-experts router (E, hidden), replicated under NxD's router name."""
    return Replicated(name, ("num_experts", H), out="mlp.router.linear_router.weight")


FAMILY = llama_like("llama", HeadGroups(scope="self_attn."), *GATED_MLP, *NORMS)
