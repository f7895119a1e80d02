"""AdamW with fp32 master weights, ZeRO-1 and global gradient-norm clipping over every rank.

Gradients. Every parameter's gradient lives in one flat fp32 buffer of the rank (fp32 params get
`.grad` as a view into it, so autograd accumulates micro-batches in place; bf16 params accumulate
into it through a post-accumulate hook). After the last micro-batch's backward:

1. data parallel: one all-reduce (sum) of the flat buffer over dp (the loss is already scaled by
   1 / (micro-batches x dp), so the sum is the global-batch mean);
2. sequence parallel: the Replicated pieces (norms, row-parallel biases) saw 1/tp of the sequence
   each: their gradients are all-reduced over tp;
3. replicas: a slice of a full tensor held by more than one piece (K/V heads under kv_multiplier
   > 1, an lm_head tied to the embedding on another stage) is ONE weight; each copy's gradient is
   only its own share, so the copies' gradients are summed over the ranks that hold them (NxD's kv
   shared group, Megatron's embedding group), and the copies stay equal. Which slices, and which
   ranks, come from the layout algebra: a `SegmentIndex` over every rank's pieces.
4. the global norm counts every weight once: Replicated pieces on tp rank 0 only, a replicated
   slice on its first holder only; the squared norms are summed over tp x pp (dp replicas hold the
   same reduced gradients). Clipping scales the flat buffer.

Update. `torch.optim.AdamW` runs on fp32 masters: the parameter itself in fp32 runs, an fp32 copy
for bf16 parameters (copied back to bf16 after the step). With ZeRO-1 each parameter is owned by
one dp rank (greedy balance by size, like torch's ZeroRedundancyOptimizer): only the owner keeps
its master weight and Adam moments and updates it, then every owner broadcasts its updated
parameters over dp.

Optimizer state is exposed keyed by piece name, `{name: {"exp_avg", "exp_avg_sq", "step"}}` (+
`"master"` for bf16 parameters), which is what layout-independent checkpoints need.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardkit.placements import SegmentIndex

from .model import ModelSpec
from .parallel import COMM, COMPUTE, Group, Parallel

log = logging.getLogger("trainer")


@dataclass
class Slot:
    """One Parameter of this rank (a tied lm_head shares its embedding's slot)."""

    names: list[str]
    param: nn.Parameter
    grad: torch.Tensor  # fp32 view into the flat gradient buffer
    replicated: bool  # a Replicated piece (every tp rank computes with the whole tensor)
    decay: bool
    owner: int = 0  # dp rank holding its optimizer state
    master: torch.Tensor | None = None
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
            holders = sorted((h.holder[0], h.holder[1], h.offset + a - h.start) for h in holdings
                             if h.start <= a and b <= h.stop)
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

    def at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
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
        return {"last_step": self.last_step, "lr": self.lr, "warmup": self.warmup, "total": self.total,
                "decay": self.decay, "min_ratio": self.min_ratio}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_step = int(state.get("last_step", 0))


class Optimizer:
    """See the module docstring. `step(lr)` synchronises, clips and updates; returns the norm."""

    def __init__(self, model: nn.Module, spec: ModelSpec, par: Parallel, *, lr: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, clip_grad: float = 1.0, zero1: bool = False,
                 sequence_parallel: bool = False, sources: Mapping[str, torch.Tensor] | None = None):
        self.par = par
        self.clip_grad = clip_grad
        self.zero1 = zero1 and par.dp > 1
        self.sequence_parallel = sequence_parallel and par.tp > 1
        self.slots = self._make_slots(model, spec.replicated_names(par.pp_rank))
        self.by_name = {n: s for s in self.slots for n in s.names}
        self.owned = self._assign_owners()
        self._plumb_gradients(sources)
        self.replica_groups = self._replica_groups(spec)
        self.adam = self._make_adam(lr, betas, eps, weight_decay)

    def _make_slots(self, model: nn.Module, replicated: set[str]) -> list[Slot]:
        """One slot per Parameter (shared ones once), its gradient a view into one flat fp32 buffer."""
        by_param: dict[int, Slot] = {}
        order: list[Slot] = []
        numel = sum(p.numel() for p in dict(model.named_parameters()).values())
        self.flat = torch.zeros(numel, dtype=torch.float32, device=self.par.device)
        offset = 0
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in by_param:
                by_param[id(p)].names.append(name)
                continue
            view = self.flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            by_param[id(p)] = slot = Slot([name], p, view, name in replicated, p.dim() >= 2)
            order.append(slot)
        return order

    def _assign_owners(self) -> list[Slot]:
        """ZeRO-1 ownership: greedy by size, identical on every dp rank (same pieces); without
        ZeRO-1 every rank owns everything. Returns the slots this rank owns."""
        par = self.par
        loads = [0] * par.dp
        for slot in self.slots:
            if self.zero1:
                slot.owner = min(range(par.dp), key=lambda r: (loads[r], r))
                loads[slot.owner] += slot.param.numel()
            else:
                slot.owner = par.dp_rank
        return [s for s in self.slots if s.owner == par.dp_rank]

    def _plumb_gradients(self, sources: Mapping[str, torch.Tensor] | None) -> None:
        """fp32 params: `.grad` is the flat buffer's view and the param its own master. bf16 params:
        an fp32 master (from the source tensor when given) on the owner, and a hook accumulating
        into the buffer."""
        for slot in self.slots:
            mine = slot.owner == self.par.dp_rank
            if slot.param.dtype == torch.float32:
                slot.param.grad = slot.grad
                if mine:
                    slot.master = slot.param
                continue
            if mine:
                source = sources.get(slot.names[0]) if sources else None
                init = (source if source is not None else slot.param.detach()).to(torch.float32)
                slot.master = nn.Parameter(init.clone(), requires_grad=False)
                slot.master.grad = slot.grad
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

    def _make_adam(self, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.AdamW | None:
        """torch's AdamW on the masters this rank owns (no weight decay for norms and biases)."""
        decay = [s.master for s in self.owned if s.decay]
        no_decay = [s.master for s in self.owned if not s.decay]
        param_groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                                    {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps) if param_groups else None

    @staticmethod
    def _accumulate_hook(slot: Slot):
        def hook(p: torch.Tensor) -> None:
            slot.grad.add_(p.grad)
            p.grad = None

        return hook

    # ---- the step -----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat.zero_()
        for slot in self.slots:
            if slot.param.dtype == torch.float32:
                slot.param.grad = slot.grad

    def sync_gradients(self) -> None:
        par = self.par
        par.dp_group.all_reduce(self.flat)
        if self.sequence_parallel:
            reps = [s.grad for s in self.slots if s.replicated]
            if reps:
                flat = _flatten_dense_tensors(reps)
                par.tp_group.all_reduce(flat)
                for g, synced in zip(reps, _unflatten_dense_tensors(flat, reps)):
                    g.copy_(synced)
        for group, intervals in self.replica_groups:
            sizes = [math.prod(iv.shape) for iv in intervals]
            buf = torch.zeros(sum(sizes), dtype=torch.float32, device=self.flat.device)
            chunks = [c.view(iv.shape) for c, iv in zip(buf.split(sizes), intervals)]
            for chunk, iv in zip(chunks, intervals):
                for held in iv.mine:
                    chunk.add_(held.region())
            group.all_reduce(buf)
            for chunk, iv in zip(chunks, intervals):
                for held in iv.mine:
                    held.region().copy_(chunk)

    def grad_norm(self) -> float:
        whole, partial = [], []
        for slot in self.slots:
            if slot.replicated and self.par.tp_rank != 0:
                continue
            (whole if slot.norm_mask is None else partial).append(slot)
        sq = torch.zeros((), dtype=torch.float64, device=self.flat.device)
        if whole:
            norms = torch._foreach_norm([s.grad for s in whole])
            sq += torch.stack(norms).double().pow(2).sum()
        for slot in partial:
            sq += (slot.grad.double().pow(2) * slot.norm_mask).sum()
        self.par.mp_group.all_reduce(sq)
        return float(sq.sqrt())

    def step(self, lr: float) -> float:
        """Synchronise, clip and update. Returns the global gradient norm (before clipping)."""
        with COMPUTE.timed():
            self.sync_gradients()
            norm = self.grad_norm()
            if not math.isfinite(norm):
                log.warning("gradient norm is %s: skipping this update", norm)
                self.zero_grad()
                return norm
            if self.clip_grad > 0:
                coef = self.clip_grad / (norm + 1e-6)
                if coef < 1.0:
                    self.flat.mul_(coef)
            if self.adam is not None:
                for group in self.adam.param_groups:
                    group["lr"] = lr
                self.adam.step()
            for slot in self.owned:
                if slot.master is not slot.param:
                    slot.param.data.copy_(slot.master.data)
            if self.zero1:
                self._broadcast_owned()
            self.zero_grad()
        return norm

    def _broadcast_owned(self) -> None:
        for owner in range(self.par.dp):
            tensors = [s.param.data for s in self.slots if s.owner == owner]
            if not tensors:
                continue
            flat = _flatten_dense_tensors(tensors)
            self.par.dp_group.broadcast(flat, src=owner)
            if owner != self.par.dp_rank:
                for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.copy_(synced)

    # ---- state by piece name ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """{piece name: {"exp_avg", "exp_avg_sq", "step"[, "master"]}} of the parameters this rank owns."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for slot in self.owned:
            state = self.adam.state.get(slot.master, {}) if self.adam is not None else {}
            if not state:
                continue
            entry = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "step": state["step"]}
            if slot.master is not slot.param:
                entry["master"] = slot.master.data
            for name in slot.names:
                out[name] = entry
        return out

    def gather_state_to_dp0(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The whole optimizer state of this (tp, pp) rank on dp rank 0 (None elsewhere). Without
        ZeRO-1 dp rank 0 has it already; with ZeRO-1 every owner sends its moments there."""
        par = self.par
        mine = self.state_dict()
        if not self.zero1:
            return mine if par.dp_rank == 0 else None
        import torch.distributed as dist

        full = dict(mine) if par.dp_rank == 0 else None
        for owner in range(1, par.dp):
            slots = [s for s in self.slots if s.owner == owner]
            if not slots or par.dp_rank not in (0, owner):
                continue
            moments = [["exp_avg", "exp_avg_sq"] + (["master"] if s.param.dtype != torch.float32 else [])
                       for s in slots]
            sizes = [s.param.numel() for s, ms in zip(slots, moments) for _ in ms] + [len(slots)]
            if par.dp_rank == owner:
                zero = {"step": torch.zeros(())}  # no update yet (e.g. a skipped non-finite step)
                entries = [mine.get(s.names[0], zero) for s in slots]
                parts = [(e[m] if m in e else torch.zeros_like(s.grad)).reshape(-1).float()
                         for s, e, ms in zip(slots, entries, moments) for m in ms]
                parts.append(torch.stack([torch.as_tensor(e["step"]).float().reshape(()) for e in entries]))
                with COMM.timed():
                    dist.send(torch.cat(parts), dst=par.dp_group.ranks[0], group=par.dp_group.pg)
                continue
            buf = torch.empty(sum(sizes), dtype=torch.float32, device=self.flat.device)
            with COMM.timed():
                dist.recv(buf, src=par.dp_group.ranks[owner], group=par.dp_group.pg)
            chunks = iter(buf.split(sizes))
            entries = []
            for s, ms in zip(slots, moments):
                entries.append({m: next(chunks).view(s.param.shape).clone() for m in ms})
            steps = next(chunks)
            for s, entry, step in zip(slots, entries, steps):
                entry["step"] = step.clone()
                for name in s.names:
                    full[name] = entry
        return full

    def load_state_dict(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take optimizer state by piece name (any names this rank does not own are ignored)."""
        if self.adam is None:
            return
        for slot in self.owned:
            entry = next((states[n] for n in slot.names if n in states), None)
            if entry is None:
                continue
            master = slot.master
            if "master" in entry and master is not slot.param:
                master.data.copy_(entry["master"].to(master.dtype))
            step = entry["step"]
            self.adam.state[master] = {
                "step": (step.detach().clone().to(torch.float32) if torch.is_tensor(step)
                         else torch.tensor(float(step))),
                "exp_avg": entry["exp_avg"].detach().to(torch.float32).clone().view(master.shape),
                "exp_avg_sq": entry["exp_avg_sq"].detach().to(torch.float32).clone().view(master.shape),
            }
