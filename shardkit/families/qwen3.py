"""Qwen3 (model_type "qwen3"): Llama's layout, `head_dim` independent of hidden/heads, and a
per-head RMSNorm on q and on k (`self_attn.q_norm`, `self_attn.k_norm`, shape (head_dim,)).

The q/k norms act on every head alike (one weight of head_dim, shared by all heads), so each tp
rank holds them whole, whatever heads it has: replicated, kept under their Hugging Face names."""

from ..placements import HeadGroups, Replicated
from .base import Family, register
from .llama import EMBEDDING, GATED_MLP, HEAD, NORMS

QK_NORMS = (Replicated("self_attn.q_norm.weight", ("head_dim",)), Replicated("self_attn.k_norm.weight", ("head_dim",)))

FAMILY = register(
    Family(
        name="qwen3",
        model_types=("qwen3",),
        first=EMBEDDING,
        layer=(HeadGroups(scope="self_attn."), *QK_NORMS, *GATED_MLP, *NORMS),
        final=HEAD,
        ignored=("*.rotary_emb.inv_freq",),
    )
)
