"""Mixture-of-experts layers with expert parallelism (Mixtral, Qwen3-MoE, DBRX), in NxD's expert layout.

Parameters. A MoE layer holds NxD's pieces: the router `mlp.router.linear_router.weight` (E, hidden),
replicated, and the experts stacked, `mlp.expert_mlps.mlp_op.gate_up_proj.weight` (E/ep, hidden,
2*I/tp) = [gate_r | up_r] and `down_proj.weight` (E/ep, I/tp, hidden), both (in, out). The expert
axis is split over ep, the intermediate axis over tp, exactly as `shardkit` shards them, so the
rank's pieces (`stage_pieces`) are its parameters.

Groups. ep ranks are carved out of the data-parallel ranks (ep divides dp): dp rank d is ep rank
d % ep of expert-data-parallel (edp) rank d // ep. The ep ranks of one (tp, pp) coordinate exchange
tokens; the dp / ep ranks holding the same experts (the edp group) reduce the experts' gradients,
while dense weights are reduced over all of dp (`optim.Optimizer`). ZeRO-1 cuts every parameter's
optimizer state over the edp group: each ep rank's rank file then holds its own ZeRO-1 shards.

Routing (transformers' Mixtral): logits = x W_router^T, p = softmax(logits in fp32), the top-k of p,
renormalised to sum 1 (Qwen3-MoE: only with `norm_topk_prob`; DBRX: divided by their
`moe_normalize_expert_weights`-norm). Each (token, choice) assignment is
sent to its expert's ep rank with one all-to-all (`dist.all_to_all_single`, which gloo supports),
computed there, and sent back with a second; the token's output is the weighted sum of its
choices. With tp > 1 every tp rank computes with its slice of the intermediate axis, so the layer's
output, the router's gradient and the input's gradient are partial sums over tp: the output is
all-reduced (g), the input gradient all-reduced (f) and the router gradient all-reduced by the
optimizer. With sequence parallelism the layer all-gathers the sequence first (its backward
reduce-scatters) and reduce-scatters its output, so every tp rank routes the same whole sequence.

Capacity (`--capacity-factor F`, 0 = no drop): in each micro-batch each expert takes at most
C = ceil(F x tokens x top-k / experts) of one rank's assignments, the rank's own tokens only (so
the drops do not depend on ep or tp). Assignments are served in a fixed order, every token's first
choice before any second choice, and within a choice by token position (sequence-major, as the
activations are laid out); the rest are dropped (that choice adds nothing; the kept weights are
not renormalised). Drops are counted in the metrics (`moe_dropped`, the fraction of assignments).

Load-balancing loss: transformers' `load_balancing_loss_func` over one micro-batch (what one
forward of transformers' model sees), all layers together: E x sum_e (c_e / N) (P_e / N), with
c_e the top-k assignments to expert e, P_e the summed router probabilities and N = layers x
tokens. c is not differentiable and the loss is linear in P, so every stage adds its layers' (P,
c) to a [2, E] tensor carried through the pipeline with the hidden states; the last stage computes
the loss from the totals and its gradient flows back to each layer's router. It is added to the
language-model loss times `router_aux_loss_coef` (the config's), as transformers does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.layout import ModelDims
from shardkit.placements import Piece

from .clocks import Clock
from .comm.base import Group
from .errors import TrainerError
from .layers import ParamHolder, TPContext, _gather_seq, _reduce_scatter_seq, copy_to_tp
from .model import ACTIVATIONS, DecoderLayer, ModelSpec, StageModel
from .parallel import Parallel

log = logging.getLogger("trainer")

ROUTER = ".router.linear_router.weight"  # under the layer's MLP (`mlp`, DBRX's `ffn`)
GATE_UP = ".expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = ".expert_mlps.mlp_op.down_proj.weight"
DISPATCH = Clock()
"""Time in the token dispatch collectives (the all-to-alls and their counts), also counted in COMM."""


# ---- checks and pieces ---------------------------------------------------------------------------------


def is_moe(spec: ModelSpec) -> bool:
    return spec.dims.num_experts > 0


def check_plan(cfg: Any, config: Mapping[str, Any], dp: int) -> None:
    """The MoE options against the model's config and the run's dp degree (bad input: one line,
    before the job starts)."""
    if cfg.capacity_factor < 0:
        raise TrainerError(f"--capacity-factor must be 0 (no drop) or positive, got {cfg.capacity_factor}")
    experts = ModelDims.from_config(config).num_experts
    if not experts:
        if cfg.ep > 1:
            raise TrainerError(
                f"--ep {cfg.ep}: {config.get('model_type', 'this')} is a dense model (no experts to split): drop --ep"
            )
        if cfg.capacity_factor:
            raise TrainerError("--capacity-factor applies to mixture-of-experts models only: drop it")
        return
    if experts % cfg.ep:
        raise TrainerError(
            f"--ep {cfg.ep} does not divide the model's {experts} experts: use an ep that divides {experts}"
        )
    if dp % cfg.ep:
        raise TrainerError(
            f"--ep {cfg.ep} does not divide the data-parallel degree {dp}: ep groups are carved out of the dp "
            f"ranks, launch dp a multiple of {cfg.ep} (tp x pp x dp processes)"
        )


def _expert_piece(name: str) -> bool:
    return name.endswith((GATE_UP, DOWN))


def stage_pieces(spec: ModelSpec, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> list[Piece]:
    """The pieces a (tp, pp, ep) rank computes with: ep rank 0's file pieces with the experts of
    `ep_rank` (the other ep ranks' files hold only their experts; the dense pieces are ep rank 0's)."""
    dense = spec.rank_pieces(tp_rank, pp_rank)
    if ep_rank == 0:
        return dense
    layout, dims = spec.layout, spec.dims
    mine = {p.name: p for p in spec.family.rank_pieces(layout, dims, tp_rank, pp_rank, spec.full_shapes, ep_rank)}
    return [mine.get(p.name, p) if _expert_piece(p.name) else p for p in dense]


def file_state(state: Mapping[str, Any], ep_rank: int) -> dict[str, Any]:
    """The part of a rank's state that its rank file holds: everything on ep rank 0, the experts
    elsewhere (NxD saves the rest once)."""
    return {k: v for k, v in state.items() if ep_rank == 0 or _expert_piece(k)}


def expert_names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if _expert_piece(n)}


def tp_partial_names(model: nn.Module) -> set[str]:
    """Replicated parameters whose gradient each tp rank computes only a part of: the routers
    (module docstring). (Qwen3-MoE's q/k norms, also partial, are summed by the attention itself:
    model.Attention._norm_heads.)"""
    return {n for n, _ in model.named_parameters() if n.endswith(ROUTER)}


# ---- token exchange --------------------------------------------------------------------------------------


class _Exchange(torch.autograd.Function):
    """Rows of `x` (grouped by destination, `send` rows each) to the ep ranks; the gradient goes
    back the same way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group: Group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        with DISPATCH.timed():
            return group.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx, grad):
        with DISPATCH.timed():
            return ctx.group.all_to_all(grad, ctx.recv, ctx.send), None, None, None


class _GatherRows(torch.autograd.Function):
    """Every group member's rows, concatenated in group order (sequence parallelism: the whole
    sequence from every tp rank's chunk; expert parallelism: every ep rank's tokens); the gradient
    of the whole (a partial sum on each member) is reduce-scattered back to the chunks."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad.contiguous(), ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """The sum over the group of every member's partial rows, each member keeping its chunk; the
    gradient of the chunk is all-gathered back."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return _reduce_scatter_seq(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad.contiguous(), ctx.group), None


_GatherFromSP = _GatherRows  # the name the sequence-parallel path has always used


# ---- the layer ----------------------------------------------------------------------------------------


class MoEStats:
    """What the MoE layers of one forward report to their stage: per layer (the [2, E] tensor of
    summed router probabilities and assignment counts, dropped assignments, assignments)."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, Any, int]] = []


class MoEBlock(nn.Module):
    """One decoder layer's MoE MLP on this rank (see the module docstring). `dense`: static shapes
    for a lazy (XLA) backend -- every ep rank gathers the group's tokens and routing weights, runs
    its experts on all of them weighted (zero for tokens not routed there) and the partial outputs
    are reduce-scattered back; no sizes are read on the host."""

    def __init__(
        self,
        spec: ModelSpec,
        ctx: TPContext,
        ep_group: Group,
        capacity_factor: float,
        stats: MoEStats,
        dtype,
        dense: bool = False,
    ):
        super().__init__()
        dims, layout = spec.dims, spec.layout
        meta = torch.device("meta")
        self.ctx, self.ep_group, self.stats, self.dense = ctx, ep_group, stats, dense
        self.experts = dims.num_experts
        self.local = dims.num_experts // layout.ep
        self.inter_local = dims.expert_intermediate_size // layout.tp
        ffn = spec.section("ffn_config")  # DBRX's names
        self.top_k = int(spec.config.get("num_experts_per_tok", ffn.get("moe_top_k", 2)))
        dbrx = spec.family.name == "dbrx"
        self.norm_topk = bool(spec.config.get("norm_topk_prob", True)) and not dbrx
        p = ffn.get("moe_normalize_expert_weights")  # DBRX: the top-k weights divided by their p-norm
        self.norm_p = float(p) if dbrx and p is not None else None
        self.capacity_factor = capacity_factor
        self.act = ACTIVATIONS[spec.activation_name]
        H = dims.hidden_size
        self.router = nn.Module()
        self.router.linear_router = ParamHolder({"weight": (self.experts, H)}, dtype, meta)
        self.expert_mlps = nn.Module()
        self.expert_mlps.mlp_op = nn.Module()
        self.expert_mlps.mlp_op.gate_up_proj = ParamHolder(
            {"weight": (self.local, H, 2 * self.inter_local)}, dtype, meta
        )
        self.expert_mlps.mlp_op.down_proj = ParamHolder({"weight": (self.local, self.inter_local, H)}, dtype, meta)

    def capacity(self, tokens: int) -> int:
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def _kept(self, expert: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """Which assignments (token-major, `expert[t * k + s]`) fit their expert's capacity: first
        choices before second ones, then by token position; None without a capacity factor."""
        if not self.capacity_factor:
            return None
        k = self.top_k
        choice = torch.arange(k, device=expert.device).repeat(tokens)
        token = torch.arange(tokens, device=expert.device).repeat_interleave(k)
        order = torch.argsort(choice * tokens + token)
        onehot = F.one_hot(expert[order], self.experts)
        position = (onehot.cumsum(0) * onehot).sum(1) - 1
        kept = torch.empty_like(expert, dtype=torch.bool)
        kept[order] = position < self.capacity(tokens)
        return kept

    def _experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `x` grouped by local expert (`counts` rows each) through their experts."""
        gate_up = self.get_parameter("expert_mlps.mlp_op.gate_up_proj.weight")
        down = self.get_parameter("expert_mlps.mlp_op.down_proj.weight")
        outs = []
        for e, rows in enumerate(x.split(counts)):
            gate, up = rows.matmul(gate_up[e]).split(self.inter_local, dim=-1)
            outs.append((self.act(gate) * up).matmul(down[e]))
        return torch.cat(outs) if outs else x.new_zeros((0, x.shape[-1]))

    def _dispatch(self, x: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Rows of `x` grouped by (global) expert to the ep ranks holding the experts, through
        them, and back, in the same order."""
        group, local = self.ep_group, self.local
        if group.size == 1:
            return self._experts(x, per_expert.tolist())
        send_counts = per_expert.view(group.size, local)
        with DISPATCH.timed():
            recv_counts = group.all_to_all(send_counts, [1] * group.size, [1] * group.size)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = _Exchange.apply(x, send, recv, group)  # by source rank, then expert
        expert = torch.arange(local, device=x.device).repeat(group.size).repeat_interleave(recv_counts.reshape(-1))
        order = torch.argsort(expert, stable=True)
        computed = self._experts(received[order], recv_counts.sum(0).tolist())
        back = torch.empty_like(computed).index_copy(0, order, computed)  # received order again
        return _Exchange.apply(back, recv, send, group)

    def _route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities [tokens, E] (fp32) and each token's top-k weights and experts."""
        logits = F.linear(flat, self.get_parameter("router.linear_router.weight"))
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, top_e = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        elif self.norm_p is not None:
            top_p = top_p / torch.norm(top_p, p=self.norm_p, dim=-1, keepdim=True)
        return probs, top_p, top_e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.sequence_parallel:  # route the whole sequence; the output is reduce-scattered
            x = _GatherRows.apply(x, self.ctx.group)
        else:
            x = copy_to_tp(x, self.ctx.group)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, top_p, top_e = self._route(flat)
        out = (
            self._forward_dense(flat, probs, top_p, top_e)
            if self.dense
            else self._forward_sparse(flat, probs, top_p, top_e)
        )
        return self.ctx.row_output(out.view(shape))

    def _forward_sparse(self, flat, probs, top_p, top_e) -> torch.Tensor:
        tokens = flat.shape[0]
        expert = top_e.reshape(-1)
        counts = torch.bincount(expert, minlength=self.experts).to(torch.float32)
        stats = torch.stack([probs.sum(0), counts])
        weight = top_p.reshape(-1)
        token = torch.arange(tokens, device=flat.device).repeat_interleave(self.top_k)
        kept = self._kept(expert, tokens)
        if kept is not None:
            expert, token, weight = expert[kept], token[kept], weight[kept]
        order = torch.argsort(expert, stable=True)
        expert, token, weight = expert[order], token[order], weight[order]
        per_expert = torch.bincount(expert, minlength=self.experts)
        outputs = self._dispatch(flat[token], per_expert)
        out = torch.zeros_like(flat).index_add(0, token, (outputs * weight.unsqueeze(-1)).to(flat.dtype))
        self.stats.layers.append((stats, tokens * self.top_k - expert.numel(), tokens * self.top_k))
        return out

    def _forward_dense(self, flat, probs, top_p, top_e) -> torch.Tensor:
        tokens, k = flat.shape[0], self.top_k
        expert = top_e.reshape(-1)
        counts = F.one_hot(expert, self.experts).sum(0).to(torch.float32)
        stats = torch.stack([probs.sum(0), counts])
        weight = top_p.reshape(-1)
        kept = self._kept(expert, tokens)
        dropped: Any = 0
        if kept is not None:
            weight = weight * kept.to(weight.dtype)
            dropped = tokens * k - kept.sum()
        routing = torch.zeros(tokens, self.experts, dtype=weight.dtype, device=flat.device)
        routing = routing.scatter_add(1, top_e, weight.view(tokens, k))  # [tokens, E], 0 where not routed
        group = self.ep_group
        rows, weights = flat, routing
        if group.size > 1:  # every ep rank's tokens and routing weights
            with DISPATCH.timed():
                rows = _GatherRows.apply(flat, group)
                weights = _GatherRows.apply(routing, group)
        local = torch.arange(self.local, device=flat.device) + group.per_rank(group.rank * self.local, top_e)
        mine = weights.index_select(1, local)  # [rows, this rank's experts]
        gate_up = self.get_parameter("expert_mlps.mlp_op.gate_up_proj.weight")
        down = self.get_parameter("expert_mlps.mlp_op.down_proj.weight")
        gate, up = torch.einsum("nh,lhi->lni", rows, gate_up).split(self.inter_local, dim=-1)
        outputs = torch.einsum("lni,lih->lnh", self.act(gate) * up, down)  # [local experts, rows, H]
        out = (outputs * mine.t().unsqueeze(-1)).sum(0).to(flat.dtype)
        if group.size > 1:  # each token's sum over every rank's experts, back to its rank
            with DISPATCH.timed():
                out = _ReduceScatterRows.apply(out, group)
        self.stats.layers.append((stats, dropped, tokens * k))
        return out


class MoEStageModel(StageModel):
    """A StageModel whose layers' MLPs are MoE layers. Its forward takes and returns, beside the
    hidden states (or logits), the [2, E] load-balancing statistics carried through the pipeline."""

    def __init__(
        self,
        spec: ModelSpec,
        ctx: TPContext,
        par: Parallel,
        dtype: torch.dtype,
        activation_checkpointing: bool = False,
        capacity_factor: float = 0.0,
    ):
        super().__init__(
            spec, ctx, par.pp_rank, dtype, par.device, activation_checkpointing, checkpoint_fn=par.comm.checkpoint
        )
        self.moe_stats = MoEStats()
        self.layer_stats: list[torch.Tensor] = []  # this forward's per-layer statistics (with their gradients)
        assert par.ep_group is not None  # init_parallel makes it
        for layer in self.layers.values():
            cast(DecoderLayer, layer).replace_mlp(
                MoEBlock(spec, ctx, par.ep_group, capacity_factor, self.moe_stats, dtype, par.comm.lazy)
            )
        self.dropped: Any = 0  # assignments dropped / routed by this stage's layers since the last take
        self.routed = 0

    def forward(self, x: torch.Tensor, carried: torch.Tensor | None = None):
        return self.run_chunk(x, self.layers.values(), self.first, self.last, *([] if carried is None else [carried]))

    def run_layer(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One layer, keeping its statistics; with activation checkpointing they are an output of
        the checkpointed function, so their gradient (the load-balancing loss's, to the router)
        survives a checkpoint that runs the forward without autograd (torch-xla's)."""

        def with_stats(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = layer(h, cos, sin)
            return out, self.moe_stats.layers[-1][0]

        if self.activation_checkpointing and torch.is_grad_enabled():
            out, stats = self.checkpoint_fn(with_stats, h, cos, sin)
        else:
            out, stats = with_stats(h, cos, sin)
        self.layer_stats.append(stats)
        return out

    def run_chunk(self, x: torch.Tensor, layers: Iterable[nn.Module], first: bool, last: bool, *carried: torch.Tensor):
        """`layers` (all of the rank's, or one virtual chunk's) and the load-balancing statistics:
        this chunk's sums plus the ones carried in from the stages before."""
        self.moe_stats.layers.clear()
        self.layer_stats.clear()
        out = self.run_layers(x, layers, first, last)
        reports = list(self.moe_stats.layers)  # read before any recomputation appends more
        total = torch.stack(self.layer_stats).sum(0)
        self.layer_stats.clear()
        if carried:
            total = total + carried[0]
        if torch.is_grad_enabled():
            self.dropped = self.dropped + sum(d for _, d, _ in reports)
            self.routed += sum(r for _, _, r in reports)
        return out, total

    def take_drops(self) -> tuple[Any, int]:
        """(dropped, routed) assignments since the last take: dropped a device tensor on a lazy backend."""
        counts = (self.dropped, self.routed)
        self.dropped = self.routed = 0
        return counts


def load_balancing_loss(carried: torch.Tensor, num_layers: int, tokens: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func from the carried totals (module docstring)."""
    probs, counts = carried[0], carried[1].detach()
    rows = float(num_layers * tokens)
    return (counts / rows * (probs / rows)).sum() * carried.shape[-1]


class MoELoss:
    """Wraps the language-model loss: adds router_aux_loss_coef x the load-balancing loss (divided
    by tp: every tp rank adds it and the router gradient is summed over tp) in training, and keeps
    the step's language-model and load-balancing sums for the metrics (device tensors, summed in
    `dtype`: nothing is read on the host in the middle of a step). Under no_grad (evaluation) it
    returns the language-model loss alone."""

    def __init__(self, base: Callable, spec: ModelSpec, scale: float, tp: int, dtype: torch.dtype = torch.float64):
        self.base, self.scale, self.tp, self.dtype = base, scale, tp, dtype
        dbrx_coef = spec.section("ffn_config").get("moe_loss_weight", 0.001)  # DBRX's name
        self.coef = float(spec.config.get("router_aux_loss_coef", dbrx_coef))
        self.layers = spec.dims.num_layers
        self.lm_sum: Any = 0.0
        self.aux_sum: Any = 0.0

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        logits, carried = output
        lm = self.base(logits, targets)
        if not torch.is_grad_enabled():
            return lm
        aux = load_balancing_loss(carried, self.layers, targets.numel())
        self.lm_sum = self.lm_sum + lm.detach().to(self.dtype)
        self.aux_sum = self.aux_sum + aux.detach().to(self.dtype) * self.scale
        return lm + aux * (self.coef * self.scale / self.tp)

    def take(self) -> tuple[Any, Any]:
        """The step's (language-model loss, load-balancing loss) sums (0.0 when no micro-batch ran here)."""
        sums = (self.lm_sum, self.aux_sum)
        self.lm_sum = self.aux_sum = 0.0
        return sums


def carry_meta(spec: ModelSpec) -> torch.Tensor:
    """The carried statistics' metadata for the pipeline stages."""
    return torch.empty(2, spec.dims.num_experts, dtype=torch.float32, device="meta", requires_grad=True)


def step_record(sums: list[float], world: int) -> dict[str, float]:
    """The step's MoE metrics from the world's sums of (load-balancing loss, dropped assignments,
    assignments, dispatch seconds)."""
    aux, dropped, routed, dispatch = sums
    return {
        "aux_loss": aux,
        "moe_dropped": dropped / routed if routed else 0.0,
        "dispatch_time": dispatch / world,
    }
