"""Phi-3 (model_type "phi3": Phi-3/3.5 mini and medium, Phi-4 mini).

Hugging Face stores attention's q, k, v as ONE tensor `self_attn.qkv_proj.weight` (rows
[q; k; v]) and the MLP's gate and up as ONE tensor `mlp.gate_up_proj.weight` (rows [gate; up]).
The rank files use Llama's NxD names (the qkv style's q/k/v pieces, `mlp.gate_up_proj.weight`
= [gate_r; up_r], `mlp.down_proj.weight`): every piece is cut at offsets inside the fused Hugging
Face tensor, and merge writes the tensors back fused. Every qkv style applies.
"""

from ..placements import Block, Fused, HeadGroups, Split
from .llama import NORMS, llama_like

GATE_UP = "mlp.gate_up_proj.weight"

FAMILY = llama_like(
    "phi3",
    HeadGroups(scope="self_attn.", fused="qkv_proj", qkv_bias=lambda dims: False, o_bias=lambda dims: False),
    Fused(GATE_UP, (Block(GATE_UP, 0, 2), Block(GATE_UP, 1, 2)), 0, ("intermediate_size", "hidden_size")),
    Split("mlp.down_proj.weight", 1, ("hidden_size", "intermediate_size")),
    *NORMS,
)
