"""AdamW with fp32 master weights, ZeRO-1 and global gradient-norm clipping over every rank.

Gradients. Every parameter's gradient lives in one flat fp32 buffer of the rank (fp32 params get
`.grad` as a view into it, so autograd accumulates micro-batches in place; bf16 params accumulate
into it through a post-accumulate hook). On a lazy (XLA) backend each gradient is an fp32 tensor of
its own instead, flattened only for a collective: XLA writes into a view of a buffer by a select
over the whole buffer, so accumulating every parameter into views of one buffer would cost the
whole buffer per parameter (the graph, its memory and its run time quadratic in the parameters).
After the last micro-batch's backward:

1. data parallel: one all-reduce (sum) of the flat buffer over dp (the loss is already scaled by
   1 / (micro-batches x dp), so the sum is the global-batch mean);
2. sequence parallel: the Replicated pieces (norms, row-parallel biases) saw 1/tp of the sequence
   each: their gradients are all-reduced over tp; so are LoRA's replicated adapter halves
   (`tp_partial`), whose gradients are partial on every tp rank (trainer/lora.py);
3. replicas: a slice of a full tensor held by more than one piece (K/V heads under kv_multiplier
   > 1, an lm_head tied to the embedding on another stage) is ONE weight; each copy's gradient is
   only its own share, so the copies' gradients are summed over the ranks that hold them (NxD's kv
   shared group, Megatron's embedding group), and the copies stay equal. Which slices, and which
   ranks, come from the layout algebra: a `SegmentIndex` over every rank's pieces.
4. the global norm counts every weight once: Replicated pieces on tp rank 0 only, a replicated
   slice on its first holder only; the squared norms are summed over tp x pp (dp replicas hold the
   same reduced gradients). Clipping scales the gradients.

Update. `torch.optim.AdamW` (or LAMB, `--optimizer lamb`: trainer/lamb.py) runs on fp32 masters: the
parameter itself in fp32 runs, an fp32 copy for bf16 parameters (copied back to bf16 after the
step). With ZeRO-1 the optimizer state is cut exactly as NxD's ZeRO-1 optimizer cuts it (torch-xla's
ZeroRedundancyOptimizer): every tp-local parameter's dim 0 is padded to a multiple of dp (with --ep:
of dp / ep, the expert-data-parallel group) and chunked, dp rank d keeps the fp32 master and Adam
moments of chunk d (`shardkit.checkpoint.zero1.dp_shard`) and updates those rows only (AdamW is
elementwise, so this is the unsharded update); then the dp ranks all-gather the updated rows.

Optimizer state is exposed keyed by piece name, `{name: {"exp_avg", "exp_avg_sq", "step"}}` (+
`"master"` for bf16 parameters), which is what layout-independent checkpoints need; with ZeRO-1
each dp rank's entries are its NxD shards, which it saves in its own `optim/dp_rank_DD_...` file.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from shardkit.checkpoint.zero1 import MOMENTS, shard_rows
from shardkit.placements import Holding, SegmentIndex

from .clocks import COMPUTE
from .comm.base import Group
from .model import ModelSpec
from .parallel import Parallel

log = logging.getLogger("trainer")
DECAY, NO_DECAY = "decay", "no_decay"
NXD_COSINE_KEYS = {"base_lrs", "last_epoch", "warmup_steps", "decay_steps", "max_steps", "min_lr"}


@dataclass
class Slot:
    """One Parameter of this rank (a tied lm_head shares its embedding's slot)."""

    names: list[str]
    param: nn.Parameter
    grad: torch.Tensor  # fp32: a view into the flat gradient buffer (a tensor of its own on a lazy backend)
    replicated: bool  # a Replicated piece (every tp rank computes with the whole tensor)
    decay: bool
    rows: tuple[int, int] = (0, 0)  # the rows of dim 0 whose optimizer state this dp rank keeps
    master: torch.Tensor | None = None  # fp32 rows `rows` (the param itself, a view of it, or a copy)
    norm_mask: torch.Tensor | None = None  # 1 where counted in the global norm (only when partly)


@dataclass
class _Held:
    slot: Slot
    dim: int
    offset: int
    length: int

    def region(self) -> torch.Tensor:
        return self.slot.grad.narrow(self.dim, self.offset, self.length)


@dataclass
class _Interval:
    """A slice of a full tensor held by several pieces (ordered holders; the first counts)."""

    shape: tuple[int, ...]
    holders: list[tuple[tuple[int, int], str, int]]  # ((pp, tp), piece name, offset)
    dim: int
    length: int
    mine: list[_Held] = field(default_factory=list)


def _rank_piece(h: Holding) -> tuple[tuple[int, int], str]:
    """The holder `_replica_intervals` indexes a piece under: ((pp, tp), piece name)."""
    return cast(tuple[tuple[int, int], str], h.holder)


def _replica_intervals(spec: ModelSpec) -> list[_Interval]:
    """Every slice of a full tensor that more than one piece of one model replica holds, from the
    layout algebra alone (no data): K/V heads replicated by kv_multiplier, a tied lm_head on
    another stage. Replicated pieces are not replicas in this sense (their compute is replicated
    too, so each copy's gradient is already whole)."""
    layout = spec.layout
    index = SegmentIndex()
    shapes = spec.full_shapes
    for pp in range(layout.pp):
        replicated = spec.replicated_names(pp)
        for tp in range(layout.tp):
            for piece in spec.rank_pieces(tp, pp):
                if piece.name in replicated or (spec.tied_alias(pp) and piece.name == "lm_head.weight"):
                    continue
                index.add(((pp, tp), piece.name), piece)
    out: list[_Interval] = []
    for source in index.sources():
        holdings = index.holdings(source)
        if len(holdings) < 2:
            continue
        dim = index.dim_of(source)
        bounds = sorted({h.start for h in holdings} | {h.stop for h in holdings})
        for a, b in zip(bounds, bounds[1:]):
            holders = sorted(
                (*_rank_piece(h), h.offset + a - h.start) for h in holdings if h.start <= a and b <= h.stop
            )
            if len(holders) > 1:
                shape = list(shapes[source])
                shape[dim] = b - a
                out.append(_Interval(tuple(shape), holders, dim, b - a))
    return out


class LRSchedule:
    """Linear warm-up to `lr`, then cosine / linear decay to lr x min_ratio at `total` (or constant)."""

    def __init__(self, lr: float, warmup: int, total: int, decay: str = "cosine", min_ratio: float = 0.1):
        self.lr, self.warmup, self.total, self.decay, self.min_ratio = lr, warmup, total, decay, min_ratio
        self.last_step = 0
        self.nxd: dict[str, Any] | None = None  # NxD's CosineAnnealing state, when resumed from one

    def at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        if self.nxd is not None:
            return self._nxd_at(step)
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.decay == "constant" or self.total <= self.warmup:
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        floor = self.lr * self.min_ratio
        if self.decay == "linear":
            return self.lr - (self.lr - floor) * progress
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, Any]:
        if self.nxd is not None:
            lr = self.at(self.last_step)
            return {
                **self.nxd,
                "last_epoch": self.last_step,
                "_step_count": self.last_step + 1,
                "_last_lr": [lr] * len(self.nxd["base_lrs"]),
            }
        return {
            "last_step": self.last_step,
            "lr": self.lr,
            "warmup": self.warmup,
            "total": self.total,
            "decay": self.decay,
            "min_ratio": self.min_ratio,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """This schedule's own state, or NxD's CosineAnnealing state_dict (an NxD checkpoint): the
        run then continues NxD's schedule (its lr, warm-up, decay and floor) instead of the options'."""
        if NXD_COSINE_KEYS <= set(state):
            self.nxd = {k: v for k, v in state.items() if k not in ("last_epoch", "_step_count", "_last_lr")}
            self.last_step = int(state["last_epoch"])
            base = {float(v) for v in state["base_lrs"]}
            if len(base) > 1:
                log.warning(
                    "the checkpoint's schedule has several base learning rates %s: using the first", sorted(base)
                )
            log.info(
                "continuing the checkpoint's NxD cosine schedule (lr %g, warm-up %d, %d decay steps to %g, "
                "max %d steps) from step %d",
                float(state["base_lrs"][0]),
                int(state["warmup_steps"]),
                int(state["decay_steps"]),
                float(state["min_lr"]),
                int(state["max_steps"]),
                self.last_step,
            )
            return
        self.last_step = int(state.get("last_step", 0))

    def _nxd_at(self, step: int) -> float:
        """NxD's CosineAnnealing (NeMo's) learning rate at `last_epoch == step`: linear warm-up
        (step + 1) / (warmup + 1), then cosine from the base lr to min_lr over decay_steps, min_lr
        after max_steps (and in the constant phase)."""
        s = self.nxd
        assert s is not None  # `at` calls this only with NxD's state
        base, floor = float(s["base_lrs"][0]), float(s["min_lr"])
        warmup, decay, max_steps = int(s["warmup_steps"]), int(s["decay_steps"]), int(s["max_steps"])
        if warmup > 0 and step <= warmup:
            return base * (step + 1) / (warmup + 1)
        if step > max_steps or (int(s.get("constant_steps") or 0) > 0 and warmup + decay < step):
            return floor
        return (base - floor) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / decay)) + floor


def buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` in reverse order (the last layers' gradients are complete first) cut into buckets
    of at most `cap_bytes`; a tensor larger than that is a bucket of its own (NxD's
    bucket_allreduce_gradients cuts so)."""
    out: list[list[torch.Tensor]] = []
    bucket: list[torch.Tensor] = []
    total = 0
    for t in reversed(tensors):
        size = t.numel() * t.element_size()
        if bucket and total + size > cap_bytes:
            out.append(bucket)
            bucket, total = [], 0
        bucket.append(t)
        total += size
    if bucket:
        out.append(bucket)
    return out


def flat_buckets(flat: torch.Tensor, cap_bytes: int) -> list[torch.Tensor]:
    """Consecutive views of a flat buffer of at most `cap_bytes` each, from its end (see `buckets`)."""
    step = max(1, cap_bytes // flat.element_size())
    return [flat[max(0, stop - step) : stop] for stop in range(flat.numel(), 0, -step)]


def _all_reduce_each(group: Group, tensors: list[torch.Tensor], cap_bytes: int) -> None:
    """Sum each of `tensors` over `group` in place, a bucket of at most `cap_bytes` per collective."""
    if group.size == 1 or not tensors:
        return
    for bucket in buckets(tensors, cap_bytes):
        group.all_reduce_many(bucket)


def run_settings(cfg: Any, restored: Any = None) -> dict[str, Any]:
    """The Optimizer's keyword arguments that the run's options give (--lr, --beta1/2, --eps,
    --weight-decay, --clip-grad, --zero1, --grad-bucket-mb, --optimizer), with a resumed
    checkpoint's fp32 masters (`restored`: checkpointing.Restored or None)."""
    masters = {n: e["master"] for n, e in restored.optimizer.items() if "master" in e} if restored else None
    return dict(
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        clip_grad=cfg.clip_grad,
        zero1=cfg.zero1,
        masters=masters,
        grad_bucket_mb=cfg.grad_bucket_mb,
        algorithm=cfg.optimizer,
    )


class Optimizer:
    """See the module docstring. `step(lr)` synchronises, clips and updates; returns the norm."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        par: Parallel,
        *,
        lr: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float = 1.0,
        zero1: bool = False,
        sequence_parallel: bool = False,
        sources: Mapping[str, torch.Tensor] | None = None,
        masters: Mapping[str, torch.Tensor] | None = None,
        experts: frozenset[str] | set[str] = frozenset(),
        tp_partial: frozenset[str] | set[str] = frozenset(),
        grad_bucket_mb: float = 512.0,
        algorithm: str = "adamw",
    ):
        self.par = par
        self.algorithm, self.spec = algorithm, spec  # "lamb": trainer/lamb.py on the same masters and state
        # gradients are reduced in buckets of at most this many bytes (bounded extra memory where a
        # bucket is flattened; separate collectives a compiler can overlap with other work)
        self.bucket_bytes = max(1, int(grad_bucket_mb * 2**20))
        self.clip_grad = clip_grad
        # a lazy (XLA) backend keeps the norm, the clipping and the skip of a non-finite step on the
        # device (read after the step's graph ran); fp32 there, as Neuron has no fp64
        self.lazy = par.comm.lazy
        self.norm_dtype = torch.float32 if self.lazy else torch.float64
        # ZeRO-1 cuts over the expert-data-parallel group: dp itself without --ep; with ep > 1 the dp
        # ranks of one ep group hold the same rows of every parameter (the experts differ anyway)
        self.zero_group = par.edp_group or par.dp_group
        self.zero_size, self.zero_rank = par.dp // par.ep, par.edp_rank
        self.zero1 = zero1 and self.zero_size > 1
        self.sequence_parallel = sequence_parallel and par.tp > 1
        # MoE (trainer/moe.py): expert gradients are reduced over the expert-data-parallel group, not
        # dp, and sit after the dense ones in the flat buffer. `tp_partial`: parameters whose gradient
        # is a partial sum over tp (a MoE router; LoRA's replicated adapter halves, trainer/lora.py)
        self.experts, self.tp_partial = set(experts), set(tp_partial)
        self.slots = self._make_slots(model, spec.replicated_names(par.pp_rank))
        self.by_name = {n: s for s in self.slots for n in s.names}
        self.owned = self._assign_rows()
        self._plumb_gradients(sources, masters or {})
        self.replica_groups = self._replica_groups(spec)
        self.initial_lr = lr
        self.adam = self._make_adam(lr, betas, eps, weight_decay)
        self.updated = False  # an update ran or state was loaded (state_dict is empty before)
        if self.lazy:
            self._initial_state()

    def _make_slots(self, model: nn.Module, replicated: set[str]) -> list[Slot]:
        """One slot per Parameter (shared ones once), its gradient a view into one flat fp32 buffer
        (`self.flat`; None on a lazy backend, where each gradient is a tensor of its own)."""
        by_param: dict[int, Slot] = {}
        order: list[Slot] = []
        numel = sum(p.numel() for p in dict(model.named_parameters()).values())
        device = self.par.device
        self.flat = None if self.lazy else torch.zeros(numel, dtype=torch.float32, device=device)
        offset = 0
        named = list(model.named_parameters(remove_duplicate=False))
        named.sort(key=lambda np: np[0] in self.experts)  # stable: the experts last
        self.dense_numel = numel
        for name, p in named:
            if id(p) in by_param:
                by_param[id(p)].names.append(name)
                continue
            if name in self.experts and offset < self.dense_numel:
                self.dense_numel = offset
            if self.flat is None:  # moved from the host: device data, not a graph of zeros (see _initial_state)
                (grad,) = self.par.comm.to_device([torch.zeros(p.shape, dtype=torch.float32)])
            else:
                grad = self.flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            by_param[id(p)] = slot = Slot([name], p, grad, name in replicated, p.dim() >= 2)
            order.append(slot)
        return order

    def _sharded(self, slot: Slot) -> bool:
        return self.zero1 and slot.param.dim() > 0

    def _rows_of(self, slot: Slot, d: int) -> tuple[int, int]:
        """dp rank d's rows of dim 0 under NxD's ZeRO-1 cut (all rows without ZeRO-1)."""
        n0 = slot.param.shape[0] if slot.param.dim() else 1
        if not self._sharded(slot):
            return 0, n0
        r = shard_rows(n0, self.zero_size)
        return min(n0, d * r), min(n0, (d + 1) * r)

    def _assign_rows(self) -> list[Slot]:
        """Which rows of each parameter this dp rank updates (NxD's ZeRO-1 cut; without ZeRO-1
        all of them). Returns the slots of which it holds at least one row."""
        for slot in self.slots:
            slot.rows = self._rows_of(slot, self.zero_rank)
        return [s for s in self.slots if s.rows[1] > s.rows[0]]

    def _plumb_gradients(self, sources: Mapping[str, torch.Tensor] | None, masters: Mapping[str, torch.Tensor]) -> None:
        """fp32 params: `.grad` is the flat buffer's view and the param its own master (with ZeRO-1
        a view of this rank's rows). bf16 params: an fp32 master of this rank's rows (from `masters`,
        a checkpoint's fp32 masters, else from the source tensor when given), and a hook
        accumulating into the buffer."""
        self.restored_masters: set[str] = set()
        for slot in self.slots:
            a, b = slot.rows
            mine = b > a
            whole = not self._sharded(slot)
            if slot.param.dtype == torch.float32:
                slot.param.grad = slot.grad
                if mine:
                    if whole:
                        slot.master = slot.param
                    else:  # updating the view updates the parameter's rows in place
                        slot.master = nn.Parameter(slot.param.data[a:b], requires_grad=False)
                        slot.master.grad = slot.grad[a:b]
                continue
            if mine:
                # the source tensor (exact fp32 values when the checkpoint has them) is on the host:
                # the master lives where the parameter and its gradient do
                source = masters.get(slot.names[0])
                if source is not None:
                    source = source.reshape(slot.param.shape)
                    self.restored_masters.add(slot.names[0])
                elif sources:
                    source = sources.get(slot.names[0])
                init = source if source is not None else slot.param.detach()
                init = init if whole else init[a:b]
                (master,) = self.par.comm.to_device([init.to(torch.float32, copy=True)])
                slot.master = nn.Parameter(master, requires_grad=False)
                slot.master.grad = slot.grad if whole else slot.grad[a:b]
            slot.param.register_post_accumulate_grad_hook(self._accumulate_hook(slot))

    def _replica_groups(self, spec: ModelSpec) -> list[tuple[Group, list[_Interval]]]:
        """The replicated slices this rank holds (kv replicas, tied embeddings across stages),
        grouped by the ranks that hold them. Every rank creates every group (same order)."""
        par = self.par
        intervals = _replica_intervals(spec)
        rank_sets = []
        for iv in intervals:
            coords = sorted({r for r, _, _ in iv.holders})
            rank_sets += [[par.global_rank(d, p, t) for p, t in coords] for d in range(par.dp)]
        groups = par.new_groups(rank_sets)
        me = (par.pp_rank, par.tp_rank)
        by_group: dict[frozenset, list[_Interval]] = {}
        for iv in intervals:
            coords = sorted({r for r, _, _ in iv.holders})
            if me not in coords:
                continue
            for position, (coord, name, off) in enumerate(iv.holders):
                if coord == me:
                    self._hold(iv, _Held(self.by_name[name], iv.dim, off, iv.length), counted=position == 0)
            by_group.setdefault(frozenset(par.global_rank(par.dp_rank, p, t) for p, t in coords), []).append(iv)
        return [(groups[key], by_group[key]) for key in sorted(by_group, key=lambda k: sorted(k))]

    @staticmethod
    def _hold(iv: _Interval, held: _Held, counted: bool) -> None:
        """Record this rank's copy of a replicated slice; only the first holder counts in the norm."""
        iv.mine.append(held)
        if not counted:
            slot = held.slot
            if slot.norm_mask is None:
                slot.norm_mask = torch.ones_like(slot.grad)
            slot.norm_mask.narrow(iv.dim, held.offset, iv.length).zero_()

    def _make_adam(self, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.Optimizer | None:
        """torch's AdamW on the masters this rank owns (no weight decay for norms and biases).
        Group 0 ("decay") and 1 ("no_decay") are NxD's two param groups."""
        self.hyper: dict[str, dict[str, Any]] = {
            kind: {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": wd}
            for kind, wd in ((DECAY, weight_decay), (NO_DECAY, 0.0))
        }
        decay = [s.master for s in self.owned if s.decay]
        no_decay = [s.master for s in self.owned if not s.decay]
        param_groups = [
            g
            for g in (
                {"params": decay, "weight_decay": weight_decay, "kind": DECAY},
                {"params": no_decay, "weight_decay": 0.0, "kind": NO_DECAY},
            )
            if g["params"]
        ]
        if not param_groups:
            return None
        if self.algorithm == "lamb":
            from .lamb import Lamb, trust_norms

            norms = trust_norms(self.owned, self.spec, self.par, self.zero_group if self.zero1 else None)
            return Lamb(param_groups, lr, tuple(betas), eps, norms)
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps)

    def _initial_state(self) -> None:
        """A lazy backend: AdamW's state of every master, zeros moved from the host (device data),
        made here in the param groups' order -- as `load_state_dict` makes a checkpoint's. XLA orders
        a graph's inputs and outputs by when their tensors were made, so a fresh run and a resumed
        one then trace the same update graph, from the first step on (one graph to compile,
        and a compile cache made by a fresh run serves a resumed one)."""
        if self.adam is None:
            return
        for group in self.adam.param_groups:
            for master in group["params"]:
                step, m, v = self.par.comm.to_device(
                    [torch.zeros(()), torch.zeros(master.shape), torch.zeros(master.shape)]
                )
                self.adam.state[master] = {"step": step, "exp_avg": m, "exp_avg_sq": v}

    @staticmethod
    def _accumulate_hook(slot: Slot):
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None  # torch runs the hook after accumulating into p.grad
            slot.grad.add_(p.grad)
            p.grad = None

        return hook

    # ---- the step -----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.flat is not None:
            self.flat.zero_()
        else:
            for slot in self.slots:
                slot.grad.zero_()
        for slot in self.slots:
            if slot.param.dtype == torch.float32:
                slot.param.grad = slot.grad

    def sync_gradients(self) -> None:
        par = self.par
        split = bool(self.experts) and par.edp_group is not par.dp_group
        cap = self.bucket_bytes
        if self.flat is None:  # a lazy backend: each gradient a tensor of its own, reduced in buckets
            experts = [s.grad for s in self.slots if split and s.names[0] in self.experts]
            dense = [s.grad for s in self.slots if not (split and s.names[0] in self.experts)]
            _all_reduce_each(par.dp_group, dense, cap)
            if experts:
                assert par.edp_group is not None  # init_parallel makes it
                _all_reduce_each(par.edp_group, experts, cap)
        else:  # views of the flat buffer, bucket by bucket: no copy
            if split:
                assert par.edp_group is not None  # init_parallel makes it
                ranges = [(par.dp_group, self.flat[: self.dense_numel]), (par.edp_group, self.flat[self.dense_numel :])]
            else:
                ranges = [(par.dp_group, self.flat)]
            for group, flat in ranges:
                if group.size > 1:
                    for bucket in flat_buckets(flat, cap):
                        group.all_reduce(bucket)
        if self.sequence_parallel or (self.tp_partial and par.tp > 1):
            reps = [
                s.grad
                for s in self.slots
                if (s.replicated and self.sequence_parallel) or (par.tp > 1 and s.names[0] in self.tp_partial)
            ]
            _all_reduce_each(par.tp_group, reps, cap)
        for group, intervals in self.replica_groups:
            sizes = [math.prod(iv.shape) for iv in intervals]
            buf = torch.zeros(sum(sizes), dtype=torch.float32, device=self.par.device)
            chunks = [c.view(iv.shape) for c, iv in zip(buf.split(sizes), intervals)]
            for chunk, iv in zip(chunks, intervals):
                for held in iv.mine:
                    chunk.add_(held.region())
            group.all_reduce(buf)
            for chunk, iv in zip(chunks, intervals):
                for held in iv.mine:
                    held.region().copy_(chunk)

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (a device tensor). The local sums come first and the reductions
        over ranks after them, in a graph of their own on a backend that wants that (Comm.isolate)."""
        whole: list[Slot] = []
        partial: list[Slot] = []
        for slot in self.slots:
            if slot.replicated and self.par.tp_rank != 0:
                continue
            (whole if slot.norm_mask is None else partial).append(slot)
        dt = self.norm_dtype
        sq = torch.zeros((), dtype=dt, device=self.par.device)
        experts = [s for s in whole if s.names[0] in self.experts]
        whole = [s for s in whole if s.names[0] not in self.experts]
        if whole:
            norms = torch._foreach_norm([s.grad for s in whole])
            sq += torch.stack(norms).to(dt).pow(2).sum()
        expert_sq = None
        if experts:  # each ep rank holds other experts: their squares add up over the ep group
            expert_sq = torch.stack(torch._foreach_norm([s.grad for s in experts])).to(dt).pow(2).sum()
        masked = []
        for slot in partial:
            assert slot.norm_mask is not None  # `partial` holds the slots with a mask
            masked.append((slot.grad.to(dt).pow(2) * slot.norm_mask).sum())
        self.par.comm.isolate()
        if expert_sq is not None:
            assert self.par.ep_group is not None  # init_parallel makes it
            sq += self.par.ep_group.all_reduce(expert_sq)
        for part in masked:
            sq += part
        self.par.mp_group.all_reduce(sq)
        return sq.sqrt()

    def step(self, lr: float) -> torch.Tensor:
        """Synchronise, clip and update. Returns the global gradient norm (before clipping), a
        tensor on the device; a non-finite norm skips the update (warned here, or on a lazy
        backend by the caller once it has read the norm)."""
        with COMPUTE.timed():
            self.sync_gradients()
            # on a backend that wants collectives in graphs of their own (Comm.isolate), the
            # gradient reductions, the norm and the update are separate graphs
            self.par.comm.isolate()
            norm = self.grad_norm()
            if self.lazy:
                self.par.comm.isolate()
                self._update_on_device(norm, lr)
            else:
                value = float(norm)
                if not math.isfinite(value):
                    log.warning("gradient norm is %s: skipping this update", value)
                    self.zero_grad()
                    return norm
                if self.clip_grad > 0:
                    coef = self.clip_grad / (value + 1e-6)
                    if coef < 1.0:
                        assert self.flat is not None  # an eager backend's buffer
                        self.flat.mul_(coef)
                if self.adam is not None:
                    for group in self.adam.param_groups:
                        group["lr"] = lr
                    self.adam.step()
            for slot in self.owned:
                if slot.param.dtype != torch.float32:
                    assert slot.master is not None  # every owned slot has a master (_plumb_gradients)
                    a, b = slot.rows
                    slot.param.data[a:b].copy_(slot.master.data)
            if self.zero1:
                self._gather_rows()
            self.zero_grad()
            self.updated = True
        return norm

    @torch.no_grad()
    def _update_on_device(self, norm: torch.Tensor, lr: float) -> None:
        """A lazy backend: clip by min(1, clip / (norm + 1e-6)) and run AdamW's update as tensors,
        skipping it on the device when the norm is not finite (nothing is read on the host).
        torch.optim.AdamW's arithmetic, with the step count and the learning rate as device
        tensors (the graph is the same every step); the state lives in `self.adam` as torch's."""
        if self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0).to(torch.float32)
            for slot in self.slots:
                slot.grad.mul_(coef)
        if self.adam is None:
            return
        ok = torch.isfinite(norm)
        if self.algorithm == "lamb":
            for group in self.adam.param_groups:
                group["lr"] = lr
            self.adam.step(ok=ok)  # type: ignore[call-overload]  # trainer/lamb.py's update on the device
            return
        lr_t = torch.tensor(lr, dtype=torch.float32, device=self.par.device)
        for group in self.adam.param_groups:
            beta1, beta2 = group["betas"]
            group["lr"] = lr
            decay = 1 - lr_t * group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.adam.state[p]  # made in advance (_initial_state, load_state_dict)
                step = state["step"] + ok.to(torch.float32)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                new_m = m.lerp(g, 1 - beta1)
                new_v = (v * beta2).addcmul(g, g, value=1 - beta2)
                # 1 - beta ** step as -expm1(step * log(beta)): in fp32, 1 - 0.999 ** step would lose
                # four digits to cancellation (Neuron has no fp64; torch computes these in fp64)
                step_size = lr_t / -torch.expm1(step * math.log(beta1))
                denom = (new_v.sqrt() / (-torch.expm1(step * math.log(beta2))).sqrt()).add(group["eps"])
                new_p = p.detach() * decay - step_size * (new_m / denom)
                p.copy_(torch.where(ok, new_p, p.detach()))
                m.copy_(torch.where(ok, new_m, m))
                v.copy_(torch.where(ok, new_v, v))
                state["step"] = step

    def _padded_rows(self, slot: Slot, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a parameter-shaped tensor as NxD's ZeRO-1 shard (zero-padded rows)."""
        a, b = slot.rows
        r = shard_rows(t.shape[0], self.zero_size)
        out = torch.zeros((r, *t.shape[1:]), dtype=t.dtype, device=t.device)
        out[: b - a].copy_(t[a:b])
        return out

    def _gather_rows(self) -> None:
        """ZeRO-1: every dp rank's updated rows to every dp rank (one all-gather per dtype; the
        rows cut and written around it in graphs of their own where Comm.isolate asks for that)."""
        by_dtype: dict[torch.dtype, list[Slot]] = {}
        for slot in self.slots:
            if self._sharded(slot):
                by_dtype.setdefault(slot.param.dtype, []).append(slot)
        sends = [
            torch.cat([self._padded_rows(s, s.param.data).reshape(-1) for s in slots]) for slots in by_dtype.values()
        ]
        self.par.comm.isolate()
        gathered = [self.zero_group.all_gather(send).view(self.zero_size, -1) for send in sends]
        self.par.comm.isolate()
        for slots, outs in zip(by_dtype.values(), gathered):
            for d in range(self.zero_size):
                if d == self.zero_rank:
                    continue
                out, offset = outs[d], 0
                for s in slots:
                    rows = shard_rows(s.param.shape[0], self.zero_size)
                    size = rows * math.prod(s.param.shape[1:])
                    a, b = self._rows_of(s, d)
                    s.param.data[a:b].copy_(out[offset : offset + size].view(rows, *s.param.shape[1:])[: b - a])
                    offset += size

    # ---- state by piece name ------------------------------------------------------------------------
    def state_dict(self, to_host: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> dict[str, Any]:
        """{piece name: {"exp_avg", "exp_avg_sq", "step"[, "master"]}}: the tp-local tensors; with
        ZeRO-1 this dp rank's NxD shard of each (dim 0 zero-padded to a multiple of dp, chunk dp_rank),
        for every parameter. Empty before the first update. `to_host`: the tensors are moved with it
        (all in one call) before any padding, which then happens on the host."""
        if self.adam is None or not self.updated:
            return {}
        held: list[dict[str, Any]] = []
        for slot in self.slots:
            state = dict(self.adam.state.get(slot.master, {})) if slot.master is not None else {}
            if state and slot.param.dtype != torch.float32:
                assert slot.master is not None  # there is state only under a master
                state["master"] = slot.master.data
            held.append({k: v for k, v in state.items() if k in (*MOMENTS, "step", "master")})
        if to_host is not None:
            keys = [(i, k) for i, state in enumerate(held) for k, v in state.items() if torch.is_tensor(v)]
            for (i, k), t in zip(keys, to_host([held[i][k] for i, k in keys])):
                held[i][k] = t
        step = next(state["step"] for state in held if state)
        out: dict[str, dict[str, Any]] = {}
        for slot, state in zip(self.slots, held):
            bf16 = slot.param.dtype != torch.float32
            if not state and not self._sharded(slot):
                continue
            if self._sharded(slot):
                shard = (shard_rows(slot.param.shape[0], self.zero_size), *slot.param.shape[1:])
                if state:
                    entry = {m: self._pad_local(state[m], shard) for m in MOMENTS}
                    entry["step"] = state["step"]
                    if bf16:
                        entry["master"] = self._pad_local(state["master"], shard)
                else:  # none of this parameter's rows is this rank's: an all-padding shard
                    entry = {m: torch.zeros(shard, dtype=torch.float32) for m in MOMENTS}
                    entry["step"] = step
                    if bf16:
                        entry["master"] = torch.zeros(shard, dtype=torch.float32)
            else:
                entry = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "step": state["step"]}
                if bf16:
                    entry["master"] = state["master"]
            for name in slot.names:
                out[name] = entry
        return out

    @staticmethod
    def _pad_local(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros(shape, dtype=t.dtype, device=t.device)
        out[: t.shape[0]].copy_(t)
        return out

    def save_param_groups(self, next_lr: float) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """NxD's two param groups' hyperparameters (as its AdamW saves them, `lr` the next step's)
        and each piece's group (0: weights with decay, 1: norms and biases)."""
        groups = []
        for kind in (DECAY, NO_DECAY):
            h = self.hyper[kind]
            groups.append(
                {
                    "weight_decay": h["weight_decay"],
                    "lr": next_lr,
                    "betas": list(h["betas"]),
                    "initial_lr": self.initial_lr,
                    "eps": h["eps"],
                    "amsgrad": False,
                    "maximize": False,
                    "foreach": None,
                    "capturable": False,
                    "differentiable": False,
                    "fused": None,
                    "decoupled_weight_decay": True,
                }
            )
        return groups, {n: 0 if s.decay else 1 for s in self.slots for n in s.names}

    def load_state_dict(
        self,
        states: Mapping[str, Mapping[str, torch.Tensor]],
        param_groups: list[Mapping[str, Any]] | None = None,
        groups: Mapping[str, int] | None = None,
    ) -> None:
        """Take optimizer state by piece name: tp-local (dp-unsharded) tensors, of which this rank
        keeps its rows (any names this rank does not hold are ignored). With the checkpoint's
        `param_groups` and each piece's group index (`groups`), its betas, eps and weight decay are
        adopted, as torch's and NxD's optimizers do on load."""
        if self.adam is None:
            return
        slot_of = {id(s.master): s for s in self.owned}
        # in the param groups' order, as _initial_state makes a fresh run's (XLA orders a graph by
        # when its tensors were made); each tensor moved from the host, so no graph is traced here
        for master in (m for group in self.adam.param_groups for m in group["params"]):
            slot = slot_of[id(master)]
            entry = next((states[n] for n in slot.names if n in states), None)
            if entry is None:
                continue
            self.updated = True
            a, b = slot.rows

            def mine(t: torch.Tensor, slot: Slot = slot, a: int = a, b: int = b) -> torch.Tensor:
                t = t.detach().to(torch.float32).reshape(slot.param.shape)
                return (t if not self._sharded(slot) else t[a:b]).clone()

            bf16 = slot.param.dtype != torch.float32
            if "master" in entry and bf16 and slot.names[0] not in self.restored_masters:
                master.data.copy_(mine(entry["master"]).to(master.device))
            step = entry["step"]
            step_t = (
                step.detach().clone().to(torch.float32).reshape(())
                if torch.is_tensor(step)
                else torch.tensor(float(step))
            )
            # torch's AdamW keeps the step on the host; the lazy update (_update_on_device) on the device
            moments = self.par.comm.to_device([mine(entry["exp_avg"]), mine(entry["exp_avg_sq"])])
            step_t = self.par.comm.to_device([step_t])[0] if self.lazy else step_t.cpu()
            self.adam.state[master] = {"step": step_t, "exp_avg": moments[0], "exp_avg_sq": moments[1]}

        if param_groups and groups:
            self._adopt_hyper(param_groups, groups, states)

    def _adopt_hyper(self, saved: list[Mapping[str, Any]], groups: Mapping[str, int], states: Mapping) -> None:
        for kind in (DECAY, NO_DECAY):
            index = {groups.get(n, 0) for s in self.slots if s.decay == (kind == DECAY) for n in s.names if n in states}
            if len(index) != 1 or next(iter(index)) >= len(saved):
                continue
            g = saved[next(iter(index))]
            h = self.hyper[kind]
            for key in ("betas", "eps", "weight_decay"):
                if key not in g:
                    continue
                value = tuple(float(v) for v in g[key]) if key == "betas" else float(g[key])
                if value != h[key]:
                    log.info(
                        "resuming with the checkpoint's %s %s for %s parameters (the options say %s)",
                        key,
                        value,
                        kind.replace("_", " "),
                        h[key],
                    )
                    h[key] = value
            assert self.adam is not None  # load_state_dict returns before this without one
            for group in self.adam.param_groups:
                if group.get("kind") == kind:
                    group.update({k: h[k] for k in ("betas", "eps", "weight_decay")})
