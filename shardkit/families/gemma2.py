"""Gemma 2 (model_type "gemma2").

Llama's layout with `head_dim` independent of hidden/heads (Gemma 2 9B: 16 heads of 256 over a
hidden size of 3584), two more replicated norms per layer (`pre_feedforward_layernorm`,
`post_feedforward_layernorm`) and tied embeddings (no `lm_head.weight` in the checkpoint; the rank
files hold the vocab-parallel `lm_head.weight` cut from the embedding, as for Llama 3.2).
Embedding scaling by sqrt(hidden), the (1 + w) norms and logit soft-capping are computations,
not weights: nothing here changes for them.
"""

from ..placements import HeadGroups
from .llama import GATED_MLP, llama_like, norms

GEMMA_NORMS = norms(
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)

FAMILY = llama_like("gemma2", HeadGroups(scope="self_attn."), *GATED_MLP, *GEMMA_NORMS)
