"""Qwen3-MoE (model_type "qwen3_moe"): Qwen3's attention (with q/k norms) and a mixture-of-experts
MLP held as NxD's expert layers hold it, exactly like Mixtral's: the router
`mlp.gate.weight` (E, hidden) becomes `mlp.router.linear_router.weight` (replicated), the experts
`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` (moe_intermediate_size rows) are stacked into
`mlp.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden, 2*I/tp) and `down_proj.weight`
(E/ep, I/tp, hidden), the expert axis split over ep.

Configs whose layers are not all MoE (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused:
one layer table describes every layer."""

from ..layout import ModelDims
from ..placements import Experts, HeadGroups
from .llama import NORMS, llama_like, router
from .qwen3 import QK_NORMS

EXPERT = "mlp.experts.{e}."


def _every_layer_moe(dims: ModelDims) -> str | None:
    if dims.dense_mlp_layers or dims.moe_every != 1:
        return (
            "layers with a dense MLP (mlp_only_layers / decoder_sparse_step > 1) are not supported yet: "
            "every layer must be a MoE layer"
        )
    if not dims.num_experts:
        return "config.json has no num_experts"
    return None


FAMILY = llama_like(
    "qwen3_moe",
    HeadGroups(scope="self_attn."),
    *QK_NORMS,
    router("mlp.gate.weight"),
    Experts(
        gate=EXPERT + "gate_proj.weight",
        up=EXPERT + "up_proj.weight",
        down=EXPERT + "down_proj.weight",
        inter="expert_intermediate_size",
    ),
    *NORMS,
    check=_every_layer_moe,
)
