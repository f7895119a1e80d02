"""Tensor-parallel building blocks (Megatron / NxD style), on activations laid out sequence-first
`[seq, batch, hidden]` so that sequence-parallel scatter/gather act on the leading dimension.

The conjugate communication ops are autograd Functions:

| op | forward | backward |
| --- | --- | --- |
| `copy_to_tp` (f) | identity | all-reduce |
| `reduce_from_tp` (g) | all-reduce | identity |
| `gather_linear` | all-gather along seq, matmul | all-gather again; reduce-scatter along seq |
| `reduce_scatter_to_sp` | reduce-scatter along seq | all-gather along seq |

A column-parallel linear takes `f` before its matmul; a row-parallel linear takes `g` (or
`reduce_scatter_to_sp`) after it. With sequence parallelism a column-parallel linear (or several
sharing one input, like q/k/v) is ONE autograd Function, `gather_linear`, Megatron's way: forward
all-gathers the sequence chunks and multiplies, but keeps only the local chunk for backward;
backward all-gathers it again for the weight gradient and reduce-scatters the input gradient. So
the activations saved for the matmuls' inputs are 1/tp of the sequence, like the norms'.

The vocabulary is split over tp for both the embedding and the output layer; the loss is a
vocab-parallel cross entropy that never gathers the logits. With tp = 1 every op is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .comm.base import Group

# ---- the conjugate ops ---------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # the incoming gradient may be shared with another branch (a residual): reduce a copy
        return ctx.group.all_reduce(grad.clone(memory_format=torch.contiguous_format)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.mark_dirty(x)
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return group.all_gather(x)


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} does not split over {group.size} tp ranks")
    return group.reduce_scatter(x)


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherLinear(torch.autograd.Function):
    """y_i = all_gather_seq(x) W_i^T (+ b_i) for several weights sharing one input, saving only
    the local chunk x (not the gathered input) for backward, where it is gathered again."""

    @staticmethod
    def forward(ctx, x, group: Group, n: int, *params):
        weights, biases = params[:n], params[n:]
        total = _gather_seq(x, group)
        outs = tuple(F.linear(total, w, b) for w, b in zip(weights, biases))
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        total = _gather_seq(x, ctx.group)  # the input again: only the local chunk was kept
        flat_total = total.reshape(-1, total.shape[-1])
        grad_total = None
        grad_weights, grad_biases = [], []
        for grad, weight, has_bias in zip(grads, weights, ctx.has_bias):
            grad_in = grad.matmul(weight)
            grad_total = grad_in if grad_total is None else grad_total.add_(grad_in)
            flat = grad.reshape(-1, grad.shape[-1])
            grad_weights.append(flat.t().matmul(flat_total) if ctx.needs_input_grad[3 + len(grad_weights)] else None)
            grad_biases.append(flat.sum(0) if has_bias else None)
        return (_reduce_scatter_seq(grad_total, ctx.group), None, None, *grad_weights, *grad_biases)


def gather_linear(
    x: torch.Tensor, group: Group, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[torch.Tensor, ...]:
    """Column-parallel matmuls of the sequence-parallel input chunk `x` (see `_GatherLinear`)."""
    return _GatherLinear.apply(x, group, len(weights), *weights, *biases)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSP.apply(x, group)


class TPContext:
    """What a tensor-parallel layer needs to know: the tp group and whether the sequence is split."""

    def __init__(self, group: Group, sequence_parallel: bool = False):
        self.group = group
        self.sequence_parallel = sequence_parallel and group.size > 1

    def column_linear(
        self, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, ...]:
        """Column-parallel matmuls sharing the input `x`: f then F.linear each, or with sequence
        parallelism `gather_linear` (only the local chunk of the input is kept for backward)."""
        if self.sequence_parallel:
            return gather_linear(x, self.group, weights, biases)
        x = copy_to_tp(x, self.group)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    def row_output(self, x: torch.Tensor) -> torch.Tensor:
        """Output of a row-parallel matmul (a partial sum): g, or its reduce-scatter over the sequence."""
        return reduce_scatter_to_sp(x, self.group) if self.sequence_parallel else reduce_from_tp(x, self.group)


# ---- layers ----------------------------------------------------------------------------------------


class ParamHolder(nn.Module):
    """A module that only holds parameters under given names (NxD's piece names)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device=None):
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))


class _TPLinear(nn.Module):
    """A linear layer's weight (out, in) and optional bias (out,) as this tp rank holds them."""

    lora: Any = None  # trainer.lora.ColumnLora / RowLora: adapters on this layer (outside the module's state)

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: TPContext, dtype, device=None):
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None


class ColumnParallelLinear(_TPLinear):
    """y_r = x W_r^T (+ b_r): W split over tp by output rows (`out_features` is this rank's
    share); the output stays split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lora or self.ctx).column_linear(x, [self.weight], [self.bias])[0]


class RowParallelLinear(_TPLinear):
    """y = sum_r x_r W_r^T (+ b): W split over tp by input columns (`in_features` is this rank's
    share); the input arrives split; the partial outputs are all-reduced (or reduce-scattered);
    the bias is added once, after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight) if self.lora is None else self.lora.partial(x, self.weight)
        out = self.ctx.row_output(partial)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Rows [r*V/tp, (r+1)*V/tp) of the embedding on tp rank r: each rank looks up the ids it
    owns, zeros the others, and the partial embeddings are summed (or reduce-scattered)."""

    def __init__(
        self, vocab_local: int, hidden: int, ctx: TPContext, dtype, padding_idx: int | None = None, device=None
    ):
        super().__init__()
        self.ctx = ctx
        self.vocab_start = ctx.group.rank * vocab_local
        self.vocab_local = vocab_local
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_start + vocab_local:
            local_pad = padding_idx - self.vocab_start
        self.padding_idx = local_pad
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [seq, batch] -> [seq, batch, hidden] (or [seq/tp, batch, hidden] with sequence parallel)."""
        if self.ctx.group.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        start = self.ctx.group.per_rank(self.vocab_start, ids)
        outside = (ids < start) | (ids >= start + self.vocab_local)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ctx.row_output(out)


class RMSNorm(nn.Module):
    """Llama's RMSNorm, with transformers' numerics (normalise in fp32, cast, then scale). `plus_one`:
    Gemma's, which scales by (1 + w) in fp32 before the cast."""

    def __init__(self, hidden: int, eps: float, dtype, device=None, plus_one: bool = False):
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the scale to use instead of the parameter (the same tensor through an autograd op)."""
        w = self.weight if weight is None else weight
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + w.float())).to(dtype)
        return w * h.to(dtype)


class LayerNorm(nn.Module):
    """torch's LayerNorm over the last dimension, with or without a bias (GPT-NeoX's; DBRX's has none)."""

    def __init__(self, hidden: int, eps: float, bias: bool, dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


# ---- vocab-parallel cross entropy ------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split along the vocabulary: per token, the max, the target's
    logit and the sum of exponentials are reduced over tp (a few floats per token), never the
    logits themselves. Megatron's algorithm."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group):
        vocab_local = logits.shape[-1]
        start = group.per_rank(group.rank * vocab_local, target)
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        group.all_reduce(logits_max, op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        both = torch.stack([predicted, exp.sum(dim=-1)])
        group.all_reduce(both)
        predicted, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - predicted
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype)
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        flat[rows, local_target.reshape(-1)] -= inside.reshape(-1)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token loss from local logits [..., V/tp] and global target ids [...] (fp32)."""
    if group.size == 1:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group)
