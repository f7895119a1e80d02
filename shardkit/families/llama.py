"""Llama (Llama 2/3, TinyLlama, Code Llama: model_type "llama").

Embedding and lm_head vocab-parallel; attention by head groups; gate and up fused into NxD's
`mlp.gate_up_proj`; o and down row-parallel; norms replicated. lm_head takes the embedding's
values when the config ties them.
"""

from ..layout import ModelDims
from ..placements import Fused, HeadGroups, Replicated, Split
from .base import Family, register


def _mlp_bias(dims: ModelDims) -> bool:
    return dims.mlp_bias


def global_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """Embedding, final norm and lm_head: shared by every decoder-only family here."""
    H, V = d.hidden_size, d.vocab_size
    return {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}


def attention_and_norm_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """Shapes of a layer's attention (with possible biases) and its two norms."""
    H, D = d.hidden_size, d.head_dim
    q, kv = d.num_heads * D, d.num_kv_heads * D
    return {
        "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
    }


def shapes(d: ModelDims):
    H, I = d.hidden_size, d.intermediate_size
    layer_shapes = {
        **attention_and_norm_shapes(d),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mlp.gate_proj.bias": (I,), "mlp.up_proj.bias": (I,), "mlp.down_proj.bias": (H,),
    }
    return global_shapes(d), layer_shapes


EMBEDDING = (Split("model.embed_tokens.weight", 0),)
NORMS = (Replicated("input_layernorm.weight"), Replicated("post_attention_layernorm.weight"))
HEAD = (Replicated("model.norm.weight"), Split("lm_head.weight", 0, tied_to="model.embed_tokens.weight"))
GATED_MLP = (
    Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0),
    Fused("mlp.gate_up_proj.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), 0, when=_mlp_bias),
    Split("mlp.down_proj.weight", 1),
    Replicated("mlp.down_proj.bias", when=_mlp_bias),
)

FAMILY = register(Family(
    name="llama",
    model_types=("llama",),
    first=EMBEDDING,
    layer=(HeadGroups(scope="self_attn."), *GATED_MLP, *NORMS),
    final=HEAD,
    shapes=shapes,
    ignored=("*.rotary_emb.inv_freq",),
))
