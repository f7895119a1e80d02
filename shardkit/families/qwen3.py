"""Qwen3 (model_type "qwen3"): Llama's layout, `head_dim` independent of hidden/heads, and a
per-head RMSNorm on q and on k (`self_attn.q_norm`, `self_attn.k_norm`, shape (head_dim,)).

The q/k norms act on every head alike (one weight of head_dim, shared by all heads), so each tp
rank holds them whole, whatever heads it has: replicated, kept under their Hugging Face names."""

from ..placements import HeadGroups, Replicated
from .llama import GATED_MLP, NORMS, llama_like

QK_NORMS = (Replicated("self_attn.q_norm.weight", ("head_dim",)), Replicated("self_attn.k_norm.weight", ("head_dim",)))

FAMILY = llama_like("qwen3", HeadGroups(scope="self_attn."), *QK_NORMS, *GATED_MLP, *NORMS)
