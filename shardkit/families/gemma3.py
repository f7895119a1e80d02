"""Gemma 3 text models (model_type "gemma3_text": Gemma 3 1B, and the language model of the
larger ones when saved as Gemma3ForCausalLM): Gemma 2's table plus Qwen3-style per-head q/k norms
(`self_attn.q_norm`, `self_attn.k_norm`, replicated). The multimodal "gemma3" checkpoints
(vision tower + language model) are not supported."""

from ..placements import HeadGroups
from .gemma2 import GEMMA_NORMS
from .llama import GATED_MLP, llama_like
from .qwen3 import QK_NORMS

FAMILY = llama_like(
    "gemma3", HeadGroups(scope="self_attn."), *QK_NORMS, *GATED_MLP, *GEMMA_NORMS, model_type="gemma3_text"
)
