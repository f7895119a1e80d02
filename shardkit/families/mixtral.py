"""Mixtral (model_type "mixtral"): Llama's attention, and a mixture-of-experts MLP laid out as
NxD's expert layers expect.

Hugging Face checkpoints store each expert's matrices separately
(`block_sparse_moe.experts.{e}.w1/w3/w2.weight` = gate, up, down) and the router as
`block_sparse_moe.gate.weight`. NxD holds `mlp.router.linear_router.weight` (replicated) and the
experts stacked: `mlp.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden, 2*I/tp) and
`down_proj.weight` (E/ep, I/tp, hidden): ExpertFusedColumn/RowParallelLinear keep (in, out)
weights. The expert axis is split over ep (v3 file names); the rest lives on ep rank 0.
"""

from ..layout import ModelDims
from ..placements import Experts, HeadGroups, Replicated
from .base import Family, register
from .llama import EMBEDDING, HEAD, NORMS, attention_and_norm_shapes, global_shapes

EXPERT = "block_sparse_moe.experts.{e}."


def shapes(d: ModelDims):
    H, I, E = d.hidden_size, d.intermediate_size, d.num_experts
    layer_shapes = {**attention_and_norm_shapes(d), "block_sparse_moe.gate.weight": (E, H)}
    for e in range(E):
        prefix = EXPERT.format(e=e)
        layer_shapes.update({prefix + "w1.weight": (I, H), prefix + "w3.weight": (I, H), prefix + "w2.weight": (H, I)})
    return global_shapes(d), layer_shapes


FAMILY = register(Family(
    name="mixtral",
    model_types=("mixtral",),
    first=EMBEDDING,
    layer=(
        HeadGroups(scope="self_attn."),
        Replicated("block_sparse_moe.gate.weight", out="mlp.router.linear_router.weight"),
        Experts(gate=EXPERT + "w1.weight", up=EXPERT + "w3.weight", down=EXPERT + "w2.weight",
                gate_up_out="mlp.expert_mlps.mlp_op.gate_up_proj.weight",
                down_out="mlp.expert_mlps.mlp_op.down_proj.weight"),
        *NORMS,
    ),
    final=HEAD,
    shapes=shapes,
    ignored=("*.rotary_emb.inv_freq",),
))
