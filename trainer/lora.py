"""LoRA fine-tuning on the tensor-parallel layers (`--lora-rank r --lora-alpha a --lora-targets ...`).

A targeted linear layer y = x W^T becomes y = x W^T + (alpha / r) * (x A^T) B^T with A (r, in) and
B (out, r), as peft computes it; W is frozen and only A and B train. Under tensor parallelism the
adapters are cut like the base weight they sit on, and the cut is shardkit's own:

- column-parallel bases (q, k, v, gate, up): B is split on its output rows exactly as W's rows are
  (the same head segments for q/k/v, kv-multiplier replicas included, whatever the qkv style; the
  gate or up rows of NxD's fused gate_up), and A is replicated;
- row-parallel bases (o, down): A is split on its input columns as W's columns are, B replicated.

The adapters form a model family of their own (shardkit's `families/lora.py`, which every
shardkit command uses for adapter checkpoints too): for every adapted weight a placement whose
pieces are the base placement's segments of that weight, re-pointed at the adapter tensor. So the layout algebra places, saves, reshards and gathers adapters like any weights: a
checkpoint holds only the adapters (shardkit's Checkpointer with the adapter family's config), a
resume on another layout reshards them, and the optimizer's replica sync finds the kv replicas of
B_k / B_v.

Gradients of the replicated halves are partial on each tp rank: a column layer's A gets
s B_r^T dy_r x^T from tp rank r (only its rows of B and of the output gradient), a row layer's B
gets s dy (x_r A_r^T)^T (only its share of the rank-r projection), so both are summed over tp
(`Optimizer(tp_partial=...)`: their names). The split halves' gradients are whole on their rank.

Initial values are drawn as peft draws them (A kaiming-uniform with a = sqrt(5), B zero), each full
A from a generator seeded by (--seed, name) alone and then sliced, so every layout starts from the
same adapters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.checkpoint import Rank
from shardkit.checkpoint.lora import write_peft
from shardkit.distributed import Job
from shardkit.families.lora import (
    TARGETS,
    LoraSettings,
    adapter_config,
    lora_family,
    saved_settings,
)
from shardkit.formats import open_checkpoint
from shardkit.io.location import remote as remote_location
from shardkit.io.safety.durable import write_text
from shardkit.io.safety.sinks import NO_SINK
from shardkit.io.safety.transaction import commit_all, staged_output
from shardkit.io.store import remote_output
from shardkit.layout import ModelDims
from shardkit.placements import Piece, Segment, build_piece

from .errors import TrainerError
from .layers import TPContext
from .model import DecoderLayer, ModelSpec, StageModel
from .parallel import Parallel
from .weights import absolute, staged_tag

log = logging.getLogger("trainer")


def parse_targets(text: str) -> tuple[str, ...]:
    """`q,k,v,o,gate,up,down` (peft's `q_proj`, ... too) -> the targets in TARGETS order."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if not names:
        raise TrainerError(f"--lora-targets is empty: name some of {','.join(TARGETS)}")
    chosen = set()
    for name in names:
        short = name.removesuffix("_proj")
        if short not in TARGETS:
            raise TrainerError(f"--lora-targets: unknown target {name!r}; known: {','.join(TARGETS)}")
        chosen.add(short)
    return tuple(t for t in TARGETS if t in chosen)


def check_options(cfg: Any) -> LoraSettings | None:
    """The run's LoRA settings from its options (None without --lora-rank), or a TrainerError."""
    if cfg.lora_rank < 0:
        raise TrainerError(
            f"--lora-rank must be a positive whole number (the adapters' rank), got {cfg.lora_rank}; "
            "leave it out (0) to train every weight"
        )
    if cfg.lora_rank == 0:
        if cfg.export_lora:
            raise TrainerError("--export-lora writes LoRA adapters: it needs --lora-rank")
        return None
    if cfg.model_config:
        raise TrainerError(
            "--lora-rank fine-tunes an existing model: give --model (adapters on --model-config's random "
            "weights would never be trained with them)"
        )
    if not cfg.model:
        raise TrainerError(
            "--lora-rank needs --model: LoRA checkpoints hold only the adapters, the frozen weights come from --model"
        )
    if not cfg.lora_alpha > 0:
        raise TrainerError(f"--lora-alpha must be positive (scaling = alpha / rank), got {cfg.lora_alpha}")
    if cfg.export_lora and not cfg.export_hf:
        raise TrainerError("--export-lora says what --export-hf writes: give --export-hf DIR")
    base = absolute(cfg.model)  # (an s3:// URL as it is)
    return LoraSettings(cfg.lora_rank, float(cfg.lora_alpha), parse_targets(cfg.lora_targets), base)


def check_checkpoint(cfg: Any, saved: Mapping[str, Any] | None, where: Path) -> None:
    """Refuse (bad input) resuming adapters without --lora-rank, full weights with it, or adapters
    of other settings (their shapes or meaning differ)."""
    have = saved_settings(saved)
    want = check_options(cfg)
    if have is None and want is None:
        return
    if want is None:
        assert have is not None
        raise TrainerError(
            f"checkpoint {where} holds LoRA adapters ({have.describe()}): resume it with --lora-rank {have.rank} "
            f"--lora-alpha {have.alpha:g} --lora-targets {','.join(have.targets)}"
        )
    if have is None:
        raise TrainerError(
            f"checkpoint {where} holds full weights, not LoRA adapters: resume it without --lora-rank, or "
            "start the LoRA run from --model with another --checkpoint-dir"
        )
    if have != want:
        raise TrainerError(
            f"checkpoint {where} holds LoRA adapters of {have.describe()}, this run asks for {want.describe()}: "
            "pass the checkpoint's settings"
        )


# ---- the adapters as a model family -----------------------------------------------------------------


def adapter_spec(spec: ModelSpec, settings: LoraSettings) -> ModelSpec:
    """The adapters as a ModelSpec (their family, shardkit's `families.lora`, the base dims, the
    run's layout): its config is what adapter checkpoints record."""
    family = lora_family(spec.family, spec.dims, settings)
    config = adapter_config(spec.config, spec.family, settings)
    return ModelSpec(config, family, ModelDims.from_config(config), spec.layout)


# ---- the adapters in the model --------------------------------------------------------------------------


class AdapterSet(nn.Module):
    """This rank's adapter pieces as parameters named exactly like the pieces
    (`model.layers.3.self_attn.q_proj.lora_B.weight`): `state_dict()` is the adapter rank file."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            module: nn.Module = self
            for part in path:
                child = module._modules.get(part)
                if child is None:
                    child = nn.Module()
                    module.add_module(part, child)
                module = child
            module.register_parameter(leaf, nn.Parameter(tensor.to(dtype).contiguous().to(device)))


@dataclass
class Adapter:
    """One adapted weight's A and B on this rank (views of AdapterSet parameters) and its scaling."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float

    def delta(self, lowrank: torch.Tensor) -> torch.Tensor:
        return F.linear(lowrank, self.B) * self.scale


class ColumnLora:
    """Column-parallel matmuls sharing one input, with adapters on runs of their output rows.

    `runs[i]` lists weight i's local output rows in order as (rows, adapter or None): q/k/v held
    fused are three runs of one weight, NxD's gate_up two. The A matrices join the base weights in
    ONE `column_linear` (so the input's gradient is reduced once, and with sequence parallelism
    gathered once); each adapted run then adds scale * B (A x)."""

    def __init__(self, ctx: TPContext, runs: list[list[tuple[int, Adapter | None]]]):
        self.ctx = ctx
        self.runs = runs
        self.adapters = [a for weight in runs for _, a in weight if a is not None]

    def column_linear(
        self, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, ...]:
        extra = len(self.adapters)
        outs = self.ctx.column_linear(x, [*weights, *(a.A for a in self.adapters)], [*biases, *([None] * extra)])
        lowrank = {id(a): u for a, u in zip(self.adapters, outs[len(weights) :])}
        result = []
        for out, runs in zip(outs[: len(weights)], self.runs):
            if all(a is None for _, a in runs):
                result.append(out)
                continue
            parts = [
                a.delta(lowrank[id(a)]) if a is not None else out.new_zeros((*out.shape[:-1], rows)) for rows, a in runs
            ]
            result.append(out + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)))
        return tuple(result)


class RowLora:
    """A row-parallel matmul with an adapter: x_r W_r^T + scale * (x_r A_r^T) B^T, a partial sum
    like the base product (reduced over tp after it, with the base)."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter

    def partial(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) + self.adapter.delta(F.linear(x, self.adapter.A))


def _runs(piece: Piece) -> list[tuple[str, int]]:
    """A column-parallel piece's local rows as runs of one source each: [(source, rows), ...]."""
    runs: list[tuple[str, int]] = []
    for seg in piece.segments:
        if runs and runs[-1][0] == seg.source:
            runs[-1] = (seg.source, runs[-1][1] + seg.length)
        else:
            runs.append((seg.source, seg.length))
    if len({s for s, _ in runs}) != len(runs):
        raise TrainerError(f"{piece.name}: the rows of one weight are not contiguous; LoRA cannot adapt it")
    return runs


@dataclass
class Lora:
    """A run's LoRA: its settings and the adapters' spec (family, config, layout)."""

    settings: LoraSettings
    spec: ModelSpec  # the adapters'
    base: ModelSpec  # the model's

    def initial(self, seed: int, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """This rank's initial adapter pieces (fp32): peft's init of the full tensors, drawn from
        (seed, name) alone and sliced, so that every layout starts from the same adapters."""
        shapes = self.spec.full_shapes
        full: dict[str, torch.Tensor] = {}

        def fetch(seg: Segment) -> torch.Tensor:
            if seg.source not in full:
                full[seg.source] = initial_tensor(seg.source, shapes[seg.source], seed)
            return full[seg.source].narrow(seg.dim, seg.start, seg.length)

        return {p.name: build_piece(p, fetch) for p in self.spec.rank_pieces(tp_rank, pp_rank)}

    def attach(
        self, model: StageModel, tensors: Mapping[str, torch.Tensor], par: Parallel, dtype: torch.dtype
    ) -> AdapterSet:
        """Freeze `model`, build the adapters from `tensors` and hook them into its layers."""
        for p in model.parameters():
            p.requires_grad_(False)
        adapters = AdapterSet(tensors, dtype, par.device)
        base_pieces = {p.name: p for p in self.base.rank_pieces(par.tp_rank, par.pp_rank)}
        scale = self.settings.scale
        targeted = {TARGETS[t] for t in self.settings.targets}

        def adapter(module: str) -> Adapter | None:
            if module.split(".", 3)[-1] not in targeted:
                return None
            A = adapters.get_parameter(module + ".lora_A.weight")
            B = adapters.get_parameter(module + ".lora_B.weight")
            return Adapter(A, B, scale)

        def column(piece_names: list[str]) -> ColumnLora | None:
            runs: list[list[tuple[int, Adapter | None]]] = []
            for name in piece_names:
                weight_runs = []
                for source, rows in _runs(base_pieces[name]):
                    a = adapter(source.removesuffix(".weight"))
                    if a is not None and a.B.shape[0] != rows:
                        raise TrainerError(f"{source}: lora_B holds {a.B.shape[0]} rows, the base piece {rows}")
                    weight_runs.append((rows, a))
                runs.append(weight_runs)
            lora = ColumnLora(model.ctx, runs)
            return lora if lora.adapters else None

        for i in model.layer_ids:
            prefix = f"model.layers.{i}."
            layer = cast(DecoderLayer, model.model.layers[str(i)])
            attn, mlp = layer.self_attn, layer.mlp
            attn.lora = column([f"{prefix}self_attn.{m}.{p}" for m, p in attn.weight_refs])
            rows = [(attn.o_proj, "self_attn.o_proj")]
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP (lora_family refuses gate/up/down targets otherwise)
                mlp.gate_up_proj.lora = column([f"{prefix}mlp.gate_up_proj.weight"])
                rows.append((mlp.down_proj, "mlp.down_proj"))
            for row, module in rows:
                a = adapter(prefix + module)
                row.lora = RowLora(a) if a is not None else None
        return adapters

    def merged(self, model: StageModel, adapters: AdapterSet, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """The rank's base pieces with scale * B A added (fp32), for the merged export."""
        state = {k: v.detach().float() for k, v in model.state_dict().items()}
        scale = self.settings.scale
        targeted = {TARGETS[t] for t in self.settings.targets}
        for piece in self.base.rank_pieces(tp_rank, pp_rank):
            offset = 0
            b_rows: dict[str, int] = {}  # per source: rows of its B piece used so far (same order as here)
            for seg in piece.segments:
                module = seg.source.removesuffix(".weight")
                if seg.source.endswith(".weight") and module.split(".", 3)[-1] in targeted:
                    A = adapters.get_parameter(module + ".lora_A.weight").detach().float()
                    B = adapters.get_parameter(module + ".lora_B.weight").detach().float()
                    W = state[piece.name]
                    if seg.dim == 0:  # column-parallel: these rows of W get B's matching rows times A
                        first = b_rows.get(module, 0)
                        W[offset : offset + seg.length] += scale * B[first : first + seg.length] @ A
                        b_rows[module] = first + seg.length
                    else:  # row-parallel: these columns of W get B times A's matching columns
                        W[:, offset : offset + seg.length] += scale * B @ A[:, offset : offset + seg.length]
                offset += seg.length
        return state


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/lora/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """peft's init of one full adapter tensor: A kaiming-uniform (a = sqrt(5)), B zero."""
    out = torch.zeros(shape, dtype=torch.float32)
    if ".lora_A." in name:
        gen = torch.Generator().manual_seed(_seed(seed, name))
        nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)
    return out


def make_lora(settings: LoraSettings | None, spec: ModelSpec) -> Lora | None:
    return Lora(settings, adapter_spec(spec, settings), spec) if settings is not None else None


# ---- PEFT export ----------------------------------------------------------------------------------------


def export_peft(
    lora: Lora,
    adapters: AdapterSet,
    par: Parallel,
    dst: str | Path,
    base_model: str | None,
    dtype: torch.dtype,
    marker: tuple[str, dict[str, Any]],
) -> str | Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, peft's names)
    to `dst`, replacing it (all ranks call this): the adapter pieces are saved as a checkpoint tag
    in a staging folder, from which rank 0 writes the folder as `shardkit ckpt export` does
    (shardkit's `checkpoint.lora.write_peft` gathers the full tensors); an s3:// `dst` is uploaded
    and committed as every shardkit output in object storage (`io.objects.upload.remote_output`)."""
    loc = remote_location(dst, "--export-hf")
    target: str | Path = str(loc) if loc is not None else Path(dst).absolute()

    def write(staging: Path) -> None:
        if not par.leader:
            return
        alone = Job()  # rank 0 alone writes the adapter folder
        into = (
            remote_output(loc, overwrite=True, what="exporting LoRA adapters")
            if loc
            else nullcontext((target, NO_SINK))
        )
        with (
            into as (folder, sink),
            staged_output(
                folder, sources=[staging], overwrite=True, what="exporting LoRA adapters", job=alone, sink=sink
            ) as out,
        ):
            write_peft(open_checkpoint(staging / "adapters"), out.path, base_model, sink=out.sink)
            write_text(out.path / marker[0], json.dumps(marker[1], indent=2) + "\n", fsync=False)
            commit_all(out, alone)

    with staged_tag(par, target, "lora") as (staging, checkpointer):
        state = {k: v.detach().to(dtype) for k, v in adapters.state_dict().items()}
        rank = Rank(tp=par.tp_rank, pp=par.pp_rank, ep=0, dp=par.dp_rank)
        checkpointer.save(staging, "adapters", state, layout=lora.spec.layout, config=lora.spec.config, rank=rank)
        par.all_ok(lambda: write(staging))
    return target
