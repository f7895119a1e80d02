"""DBRX (model_type "dbrx"), laid out as NxD's DBRX example (`examples/training/dbrx`) holds it:
its model (`modeling_dbrx_moe_nxd.py`) keeps Hugging Face's module tree (`transformer.wte`,
`transformer.blocks.{i}.norm_attn_norm.{norm_1,attn,norm_2}`, `ffn`, `transformer.norm_f`,
`lm_head`) and swaps in NxD's parallel layers, so its example converter (`convert_checkpoints.py`)
keeps those names and renames only what the new layers call differently:

- `norm_attn_norm.attn.Wqkv.weight`, q, k and v fused (rows [q; k; v]), is cut at offsets inside
  it, like Phi-3's qkv_proj; the pieces get the layout's qkv-style names under the same
  `norm_attn_norm.attn.` scope (NxD's model uses the GQA layer: `qkv_proj.weight_q/_k/_v`);
  `out_proj` becomes the row-parallel `o_proj`; `clip_qkv` is a computation, not a weight;
- `norm_attn_norm.norm_1/norm_2.weight` (LayerNorms without bias), replicated, names kept;
- `ffn.router.layer.weight` (E, hidden) -> `ffn.router.linear_router.weight`, replicated;
- `ffn.experts.mlp.w1`, `v1`, `w2`, each ONE flat (E * ffn_hidden_size, hidden) tensor -> NxD's
  `ffn.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden, 2*I/tp) = [w1_e^T | v1_e^T] (gate
  and up transposed as NxD's expert layers hold (in, out)) and `down_proj.weight` (E/ep, I/tp,
  hidden) = w2_e as stored (w2 is already (in, out)).
`transformer.wte.weight` and `lm_head.weight` are vocab-parallel, `transformer.norm_f.weight`
replicated. fixtures/dbrx-nxd-reference/ compares these files with the example converter's.
"""

from ..placements import FlatExperts, HeadGroups, Replicated, Split
from .base import Family, register

H, V = "hidden_size", "vocab_size"
EXPERTS = "ffn.experts.mlp."

FAMILY = register(
    Family(
        name="dbrx",
        first=(Split("transformer.wte.weight", 0, (V, H)),),
        layer=(
            HeadGroups(
                scope="norm_attn_norm.attn.",
                fused="Wqkv",
                o="out_proj",
                o_out="o_proj",
                qkv_bias=lambda dims: False,
                o_bias=lambda dims: False,
            ),
            Replicated("ffn.router.layer.weight", ("num_experts", H), out="ffn.router.linear_router.weight"),
            FlatExperts(
                gate=EXPERTS + "w1",
                up=EXPERTS + "v1",
                down=EXPERTS + "w2",
                gate_up_out="ffn.expert_mlps.mlp_op.gate_up_proj.weight",
                down_out="ffn.expert_mlps.mlp_op.down_proj.weight",
            ),
            Replicated("norm_attn_norm.norm_1.weight", (H,)),
            Replicated("norm_attn_norm.norm_2.weight", (H,)),
        ),
        final=(
            Replicated("transformer.norm_f.weight", (H,)),
            Split("lm_head.weight", 0, (V, H), tied_to="transformer.wte.weight"),
        ),
        ignored=("*.rotary_emb.inv_freq",),
        layer_prefix="transformer.blocks.{i}.",
    )
)
