"""DBRX (model_type "dbrx"), laid out as NxD's DBRX example (`examples/training/dbrx`, its
`convert_checkpoints.py`) writes it: Llama-style NxD names (`model.layers.{i}.`, the layout's
qkv-style attention pieces, `input_layernorm`/`post_attention_layernorm`, `model.embed_tokens`,
`model.norm`) and NxD's expert layers.

Hugging Face stores, per block `transformer.blocks.{i}.`:
- `norm_attn_norm.attn.Wqkv.weight`, q, k and v fused (rows [q; k; v]): cut at offsets inside it,
  like Phi-3's qkv_proj; `out_proj` row-parallel; `clip_qkv` is a computation, not a weight;
- `norm_attn_norm.norm_1/norm_2.weight` (LayerNorms without bias), replicated;
- `ffn.router.layer.weight` (E, hidden) -> `mlp.router.linear_router.weight`, replicated;
- `ffn.experts.mlp.w1`, `v1`, `w2`, each ONE flat (E * ffn_hidden_size, hidden) tensor -> NxD's
  `mlp.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden, 2*I/tp) = [w1_e^T | v1_e^T] (gate
  and up transposed as NxD's expert layers hold (in, out)) and `down_proj.weight` (E/ep, I/tp,
  hidden) = w2_e as stored (w2 is already (in, out)).
`transformer.wte.weight` and `lm_head.weight` are vocab-parallel, `transformer.norm_f.weight`
replicated.
"""

from ..placements import FlatExperts, HeadGroups, Replicated, Split
from .base import Family, register
from .llama import router

H, V = "hidden_size", "vocab_size"
EXPERTS = "ffn.experts.mlp."

FAMILY = register(
    Family(
        name="dbrx",
        model_types=("dbrx",),
        first=(Split("transformer.wte.weight", 0, (V, H), out="model.embed_tokens.weight"),),
        layer=(
            HeadGroups(
                scope="norm_attn_norm.attn.",
                fused="Wqkv",
                o="out_proj",
                out_scope="self_attn.",
                o_out="o_proj",
                qkv_bias=lambda dims: False,
                o_bias=lambda dims: False,
            ),
            router("ffn.router.layer.weight"),
            FlatExperts(gate=EXPERTS + "w1", up=EXPERTS + "v1", down=EXPERTS + "w2"),
            Replicated("norm_attn_norm.norm_1.weight", (H,), out="input_layernorm.weight"),
            Replicated("norm_attn_norm.norm_2.weight", (H,), out="post_attention_layernorm.weight"),
        ),
        final=(
            Replicated("transformer.norm_f.weight", (H,), out="model.norm.weight"),
            Split("lm_head.weight", 0, (V, H), tied_to="transformer.wte.weight"),
        ),
        ignored=("*.rotary_emb.inv_freq",),
        layer_prefix="transformer.blocks.{i}.",
        out_layer_prefix="model.layers.{i}.",
    )
)
