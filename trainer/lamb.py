"""LAMB (`--optimizer lamb`), as NxD's BERT pre-training example runs it: timm's `Lamb` with
`trust_clip=True` (the example's choice), its other settings at their defaults.

Per parameter p with gradient g (already clipped by the trainer's global-norm clipping, which is
timm's `max_grad_norm` rule), at step t of its group (lr, beta1, beta2, eps, weight decay wd):

    m = beta1 m + (1 - beta1) g                     v = beta2 v + (1 - beta2) g^2
    u = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps)  + wd p
    r = min(1, ||p|| / ||u||)   (1 when ||p|| or ||u|| is 0)          p = p - lr r u

The trust ratio r applies where wd != 0 (timm's default `always_adapt=False`: the group without
weight decay, norms and biases, updates as Adam). ||p|| and ||u|| are the norms of the WHOLE
tensor, the Hugging Face one: a rank holds only its piece of a tp-split tensor (and, with ZeRO-1,
only its rows), so each rank adds the squares of its share per full tensor (`TrustNorms`: a
replicated piece counted on tp rank 0, a replicated slice on its first holder), one all-reduce
over the model-parallel ranks (and one over the ZeRO-1 group) sums them, and every rank scales
its share by its tensor's ratio. That is timm's `Lamb` on the unsharded model, in every layout
(NxD's example runs timm's `Lamb` on each rank's own shard, whose norm is not the tensor's).
A piece made of several full tensors (a fused qkv) takes each segment's own tensor's ratio.

The state is Adam's (`exp_avg`, `exp_avg_sq`, `step` per parameter), so checkpoints keep NxD's
ZeRO-1 optimizer format and resume in any layout as AdamW's do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TrainerError


@dataclass
class Region:
    """A block of a master tensor that comes from one full tensor (`source`, an index)."""

    source: int
    dim: int
    start: int
    length: int
    counted: bool  # this rank's squares count (a replicated piece: tp rank 0 only)
    mask: torch.Tensor | None = None  # 1 where counted, for a region holding replicated slices


class TrustNorms:
    """The squared norms of whole tensors from every rank's share (module doc): `regions[i]` are
    master i's blocks, `reduce` sums a [2, sources] tensor over the ranks that share the model."""

    def __init__(self, sources: int, regions: dict[int, list[Region]], reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.sources, self.regions, self.reduce = sources, regions, reduce

    def ratios(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], clip: bool) -> list[torch.Tensor]:
        """For each (master, update): the trust ratio to multiply the update by (a scalar, or a
        tensor of the master's shape when its blocks come from several tensors)."""
        index, squares = [], []
        for master, update in pairs:
            for r in self.regions[id(master)]:
                if not r.counted:
                    continue
                w, u = (t.narrow(r.dim, r.start, r.length).float().pow(2) for t in (master, update))
                if r.mask is not None:
                    w, u = w * r.mask, u * r.mask
                index.append(r.source)
                squares.append(torch.stack([w.sum(), u.sum()]))
        device = pairs[0][0].device
        total = torch.zeros(2, self.sources, dtype=torch.float32, device=device)
        if squares:
            at = torch.tensor(index, dtype=torch.long).to(device)
            total.index_add_(1, at, torch.stack(squares, dim=1))
        w_norm, u_norm = self.reduce(total).sqrt().unbind(0)
        one = torch.ones_like(w_norm)
        ratio = torch.where(w_norm > 0, torch.where(u_norm > 0, w_norm / u_norm, one), one)
        if clip:
            ratio = ratio.clamp(max=1.0)
        out = []
        for master, _ in pairs:
            regions = self.regions[id(master)]
            if len(regions) == 1:
                out.append(ratio[regions[0].source])
                continue
            scale = torch.ones_like(master)
            for r in regions:
                scale.narrow(r.dim, r.start, r.length).fill_(ratio[r.source])
            out.append(scale)
        return out


class Lamb(torch.optim.Optimizer):
    """LAMB over fp32 masters (module doc); param groups as the trainer's AdamW's (`weight_decay`
    per group). `step(ok)`: with `ok` (a device bool), the update is skipped on the device when
    False (a lazy backend's non-finite gradient norm), nothing read on the host."""

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float, norms: TrustNorms):
        super().__init__(param_groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.norms = norms
        self.trust_clip = True  # NxD's example: Lamb(..., trust_clip=True)

    @torch.no_grad()
    def step(self, closure: None = None, ok: torch.Tensor | None = None) -> None:  # type: ignore[override]
        adapted: list[tuple[torch.Tensor, torch.Tensor]] = []
        plain: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._moments(p, beta1, beta2, group["eps"], ok)
                if group["weight_decay"] != 0:
                    update.add_(p.detach(), alpha=group["weight_decay"])
                    adapted.append((p, update))
                plain.append((p, update, group["lr"]))
        ratios = dict(zip((id(p) for p, _ in adapted), self.norms.ratios(adapted, self.trust_clip))) if adapted else {}
        for p, update, lr in plain:
            ratio = ratios.get(id(p))
            step = update * ratio if ratio is not None else update
            new = p.detach() - lr * step
            p.copy_(new if ok is None else torch.where(ok, new, p.detach()))

    def _moments(
        self, p: torch.Tensor, beta1: float, beta2: float, eps: float, ok: torch.Tensor | None
    ) -> torch.Tensor:
        """Advance p's moments and step (where `ok`); the Adam direction of this step."""
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
        assert g is not None  # step() skips parameters without a gradient
        new_m = m.lerp(g, 1 - beta1)
        new_v = (v * beta2).addcmul(g, g, value=1 - beta2)
        if ok is None:  # eager: the step count on the host, bias corrections as timm's (Python floats)
            step = state["step"] + 1
            t = float(step)
            c1, c2 = 1 - beta1**t, 1 - beta2**t
            update = (new_m / c1) / (new_v.sqrt() / math.sqrt(c2) + eps)
            m.copy_(new_m)
            v.copy_(new_v)
        else:  # lazy: on the device; 1 - beta^t as -expm1(t log beta) (no cancellation in fp32)
            step = state["step"] + ok.to(torch.float32)
            c1 = -torch.expm1(step * math.log(beta1))
            c2 = -torch.expm1(step * math.log(beta2))
            update = (new_m / c1) / (new_v.sqrt() / c2.sqrt() + eps)
            m.copy_(torch.where(ok, new_m, m))
            v.copy_(torch.where(ok, new_v, v))
        state["step"] = step
        return update


def trust_norms(slots: Sequence[Any], spec: Any, par: Any, zero_group: Any | None) -> TrustNorms:
    """The blocks of each owned master (trainer/optim.py's slots: `names`, `param`, `master`,
    `rows`, `replicated`, `norm_mask`) by full tensor, from the rank's pieces; `zero_group`: the
    ZeRO-1 group whose ranks hold other rows (None without ZeRO-1)."""
    pieces = {p.name: p for p in spec.rank_pieces(par.tp_rank, par.pp_rank)}
    index = {name: i for i, name in enumerate(spec.full_shapes)}
    regions: dict[int, list[Region]] = {}
    for slot in slots:
        if slot.master is None:
            continue
        piece = pieces[slot.names[0]]
        if piece.stacked or piece.transposed:
            raise TrainerError(f"--optimizer lamb: {piece.name} holds stacked experts, which LAMB does not handle here")
        a, b = slot.rows
        counted = not (slot.replicated and par.tp_rank != 0)
        mask = slot.norm_mask[a:b] if slot.norm_mask is not None and slot.param.dim() else slot.norm_mask
        blocks, offset, dim = [], 0, piece.cat_dim
        for seg in piece.slabs[0]:
            start, length = offset, seg.length
            offset += seg.length
            if dim == 0 and slot.param.dim():  # the master holds rows [a, b) of the parameter
                lo, hi = max(start, a), min(start + length, b)
                if hi <= lo:
                    continue
                start, length = lo - a, hi - lo
            part = mask.narrow(dim, start, length) if mask is not None else None
            blocks.append(Region(index[seg.source], dim, start, length, counted, part))
        regions[id(slot.master)] = blocks

    def reduce(total: torch.Tensor) -> torch.Tensor:
        total = par.mp_group.all_reduce(total)
        return zero_group.all_reduce(total) if zero_group is not None else total

    return TrustNorms(len(index), regions, reduce)
