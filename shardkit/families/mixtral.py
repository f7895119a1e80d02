"""Mixtral (model_type "mixtral"): Llama's attention, and a mixture-of-experts MLP laid out as
NxD's expert layers expect.

Hugging Face checkpoints store each expert's matrices separately
(`block_sparse_moe.experts.{e}.w1/w3/w2.weight` = gate, up, down) and the router as
`block_sparse_moe.gate.weight`. NxD holds `mlp.router.linear_router.weight` (replicated) and the
experts stacked: `mlp.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden, 2*I/tp) and
`down_proj.weight` (E/ep, I/tp, hidden): ExpertFusedColumn/RowParallelLinear keep (in, out)
weights. The expert axis is split over ep (v3 file names); the rest lives on ep rank 0.
"""

from ..placements import Experts, HeadGroups
from .llama import NORMS, llama_like, router

EXPERT = "block_sparse_moe.experts.{e}."


FAMILY = llama_like(
    "mixtral",
    HeadGroups(scope="self_attn."),
    router("block_sparse_moe.gate.weight"),
    Experts(gate=EXPERT + "w1.weight", up=EXPERT + "w3.weight", down=EXPERT + "w2.weight"),
    *NORMS,
)
