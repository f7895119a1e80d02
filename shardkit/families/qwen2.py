"""Qwen2 (model_type "qwen2"): Llama's layout, with biases on q, k and v (none on o).

The biases follow their weights' rows, so kv replication and q head reordering apply to them
exactly as to the weights (HeadGroups cuts weights and biases from the same head list)."""

from ..placements import HeadGroups
from .base import Family, register
from .llama import EMBEDDING, GATED_MLP, HEAD, NORMS

FAMILY = register(
    Family(
        name="qwen2",
        model_types=("qwen2",),
        first=EMBEDDING,
        layer=(
            HeadGroups(scope="self_attn.", qkv_bias=lambda dims: True, o_bias=lambda dims: False),
            *GATED_MLP,
            *NORMS,
        ),
        final=HEAD,
        ignored=("*.rotary_emb.inv_freq",),
    )
)
