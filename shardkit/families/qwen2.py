"""Qwen2 (model_type "qwen2"): Llama's layout, with biases on q, k and v (none on o).

The biases follow their weights' rows, so kv replication and q head reordering apply to them
exactly as to the weights (HeadGroups cuts weights and biases from the same head list)."""

from ..placements import HeadGroups
from .llama import GATED_MLP, NORMS, llama_like

FAMILY = llama_like(
    "qwen2",
    HeadGroups(scope="self_attn.", qkv_bias=lambda dims: True, o_bias=lambda dims: False),
    *GATED_MLP,
    *NORMS,
)
