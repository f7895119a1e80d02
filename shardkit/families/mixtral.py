"""Mixtral (model_type "mixtral"): Llama's attention, and a mixture-of-experts MLP laid out as
NxD's expert layers expect.

Hugging Face checkpoints store each expert's matrices separately
(`block_sparse_moe.experts.{e}.w1/w3/w2.weight` = gate, up, down) and the router as
`block_sparse_moe.gate.weight`. NxD holds `mlp.router.linear_router.weight` (replicated) and the
experts stacked: `mlp.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden, 2*I/tp) and
`down_proj.weight` (E/ep, I/tp, hidden): ExpertFusedColumn/RowParallelLinear keep (in, out)
weights. The expert axis is split over ep (v3 file names); the rest lives on ep rank 0.
"""

from ..placements import Experts, HeadGroups, Replicated
from .base import Family, register
from .llama import EMBEDDING, HEAD, NORMS

EXPERT = "block_sparse_moe.experts.{e}."


FAMILY = register(
    Family(
        name="mixtral",
        model_types=("mixtral",),
        first=EMBEDDING,
        layer=(
            HeadGroups(scope="self_attn."),
            Replicated(
                "block_sparse_moe.gate.weight", ("num_experts", "hidden_size"), out="mlp.router.linear_router.weight"
            ),
            Experts(
                gate=EXPERT + "w1.weight",
                up=EXPERT + "w3.weight",
                down=EXPERT + "w2.weight",
                gate_up_out="mlp.expert_mlps.mlp_op.gate_up_proj.weight",
                down_out="mlp.expert_mlps.mlp_op.down_proj.weight",
            ),
            *NORMS,
        ),
        final=HEAD,
        ignored=("*.rotary_emb.inv_freq",),
    )
)
