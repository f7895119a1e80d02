"""torchtitan-shaped DCP checkpoints, written by torch's own DCP from a model sharded with FSDP2
(releases 0.1-0.2 here; 0.3, with its fused q/k/v, below).

Written from torchtitan's own code (`torchtitan/components/checkpoint.py`, `optimizer.py`,
`models/llama3/model/state_dict_adapter.py`, releases 0.1-0.2), never from shardkit's:

- the model's parameters as torchtitan's Llama 3 names them (`tok_embeddings.weight`,
  `layers.{i}.attention.wq.weight`, ..., `output.weight`), q and k rows in torchtitan's order:
  each head's rows viewed as (2, head_dim / 2) and transposed (its `_reverse_permute`);
- `CheckpointManager.save`: the model's state dict at the top level (`_flattened_model_states_sd`),
  `optimizer` (`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`: keys
  `state.<fqn>.exp_avg|exp_avg_sq|step` and `param_groups.<fqn>.<hyperparameter>`),
  `lr_scheduler` (the first scheduler's state dict), `dataloader`, `train_state` ({step,
  ntokens_seen}), saved by `dcp.save` from every rank;
- each parameter sharded by FSDP2 (`fully_shard`) over `world` gloo processes: every tensor is
  saved as dim-0 chunks, one per rank.

`build(out, state, config, world)`: `state` is a torch file of {"model": titan-named full
tensors, "optimizer": {name: {"step", "exp_avg", "exp_avg_sq"}}, "hyper": {...},
"lr_scheduler": {...}, "train_state": {...}} (see `titan_state`).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

HF_TO_TITAN = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def titan_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face q or k rows -> torchtitan's: per head, (2, d/2) -> (d/2, 2)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's q or k rows -> Hugging Face's (the inverse of `titan_rows`)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _renamed(
    state: dict[str, torch.Tensor], config: dict, table: dict[str, str], rows, prefix: str, q: str, k: str
) -> dict[str, torch.Tensor]:
    """`state` under `table`'s names ({} = the layer index after `prefix`), q and k rows by `rows`."""
    out = {}
    for key, value in state.items():
        layer = key[len(prefix) :].split(".")[0] if key.startswith(prefix) else None
        abstract = key.replace(f".{layer}.", ".{}.", 1) if layer is not None else key
        if abstract.endswith(q):
            value = rows(value, config["num_attention_heads"])
        elif abstract.endswith(k):
            value = rows(value, config["num_key_value_heads"])
        out[table[abstract].format(layer)] = value
    return out


def to_titan(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict under torchtitan 0.2's names and row order."""
    return _renamed(hf, config, HF_TO_TITAN, titan_rows, "model.layers.", "q_proj.weight", "k_proj.weight")


def to_hf(titan: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The inverse of `to_titan`."""
    back = {v: k for k, v in HF_TO_TITAN.items()}
    return _renamed(titan, config, back, hf_rows, "layers.", "attention.wq.weight", "attention.wk.weight")


class _Norm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class _Attention(nn.Module):
    def __init__(self, h: int, q: int, kv: int):
        super().__init__()
        self.wq, self.wk, self.wv = (
            nn.Linear(h, q, bias=False),
            nn.Linear(h, kv, bias=False),
            nn.Linear(h, kv, bias=False),
        )
        self.wo = nn.Linear(q, h, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(h, i, bias=False),
            nn.Linear(i, h, bias=False),
            nn.Linear(h, i, bias=False),
        )


class _Block(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.attention = _Attention(h, cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d)
        self.attention_norm = _Norm(h)
        self.feed_forward = _FeedForward(h, cfg["intermediate_size"])
        self.ffn_norm = _Norm(h)


class TitanLlama(nn.Module):
    """Parameters named and ordered as torchtitan's Llama 3 `Transformer` (no forward needed)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleDict({str(i): _Block(cfg) for i in range(cfg["num_hidden_layers"])})
        self.norm = _Norm(h)
        self.output = nn.Linear(h, cfg["vocab_size"], bias=False)


def _warmup(step: int, steps: int) -> float:
    """A linear warm-up, given to LambdaLR through functools.partial as torchtitan does."""
    return min(1.0, (step + 1) / steps)


HYPER = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def titan_state(hf: dict[str, torch.Tensor], config: dict, steps: int = 2, seed: int = 0) -> dict:
    """A torchtitan training state: the HF weights under torchtitan's names, then `steps` AdamW
    steps (torch's AdamW, torchtitan's default hyperparameters) on seeded gradients, with a
    LambdaLR schedule; everything in full (unsharded) tensors."""
    torch.manual_seed(seed)
    model = TitanLlama(config)
    model.load_state_dict(to_titan(hf, config))
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup, steps=10))
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    names = [n for n, _ in model.named_parameters()]
    state = optimizer.state_dict()
    moments = {names[i]: {k: v.clone() for k, v in entry.items()} for i, entry in state["state"].items()}
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": moments,
        "hyper": {k: v for k, v in state["param_groups"][0].items() if k != "params"},
        "lr_scheduler": scheduler.state_dict(),
        "train_state": {"step": steps, "ntokens_seen": 1234 * steps},
    }


def _worker(rank: int, world: int, port: int, state_path: str, config: str, out: str, model_only: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = json.loads(Path(config).read_text())
        full = torch.load(state_path, weights_only=True)
        mesh = init_device_mesh("cpu", (world,))
        model = TitanLlama(cfg)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        set_model_state_dict(model, full["model"], options=StateDictOptions(full_state_dict=True))
        states: dict = dict(get_model_state_dict(model))
        if not model_only:
            optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
            torch.optim.lr_scheduler.LambdaLR(
                optimizer, functools.partial(_warmup, steps=10)
            )  # as torchtitan builds it
            keyed = {"state": full["optimizer"], "param_groups": [{**full["hyper"], "params": list(full["optimizer"])}]}
            set_optimizer_state_dict(model, optimizer, keyed, options=StateDictOptions(full_state_dict=True))
            states["optimizer"] = get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
            states["lr_scheduler"] = full["lr_scheduler"]
            states["dataloader"] = {f"dp_rank_{rank}": {"sample_idx": 17 + rank}}
            states["train_state"] = full["train_state"]
        dcp.save(states, checkpoint_id=out)
    finally:
        dist.destroy_process_group()
    exit_saved()


def exit_saved() -> None:
    """End a spawned worker whose work is saved without the interpreter's teardown: torch's C++
    threads, destroyed by static destructors at exit, now and then abort the process ("terminate
    called without an active exception", SIGABRT) after every rank saved and left its group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _preload() -> None:
    """Import what the workers use before they are forked. Forked, not spawned: a spawned worker
    imports torch and this module again (seconds each on 2 cores); the parent has run no torch op
    yet, so no thread pool is forked."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401


def build(out: Path, state_path: Path, config: Path, world: int = 2, model_only: bool = False) -> None:
    """Save the state of `state_path` (`titan_state`) as torchtitan does, by FSDP2 over `world`
    gloo processes, into the DCP folder `out`."""
    import torch.multiprocessing as mp

    _preload()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _worker,
        args=(world, port, str(state_path), str(config), str(out), model_only),
        nprocs=world,
        start_method="fork",
    )


# ---- torchtitan 0.3 ----------------------------------------------------------------------------
#
# What torchtitan 0.3 saves (`components/checkpointer/`, `components/optimizer/`,
# `models/common/attention.py`, `models/llama3/`):
#
# - the model's state dict (`ModelWrapper`: `model.state_dict()`) under 0.3's names
#   (`layers.{i}.attention.qkv_linear.wq|wk|wv.weight`, `lm_head.weight`; q/k rows as 0.2's). Every
#   llama3 config fuses q, k and v into one parameter, `qkv_linear.wqkv.weight` (`FusedQKVLinear`):
#   its rows are, per kv head, the group's q heads, then that kv head's k head, then its v head; a
#   state-dict post-hook splits it into wq/wk/wv when saving, a load pre-hook fuses them back;
# - `optimizer`: the optimizer built with each parameter's name (`param_names`, from
#   `named_parameters()`), its state dict re-keyed by those names and flattened
#   (`get_flat_optim_state_dict`: `state.<name>.<key>`, `param_groups.<name>.<key>`), so the fused
#   parameter's moments are under `qkv_linear.wqkv.weight`; loaded by `load_flat_optim_state_dict`
#   after `init_optim_state` (a zero-gradient, zero-lr step makes the state to load into);
# - `lr_scheduler` = {"last_epoch"}, `dataloader`, `train_state` = {"step", "ntokens_seen"}.
#
# The hooks and the optimizer functions run are torchtitan 0.3's own where its files are here
# (TORCHTITAN_SRC: `scripts/check_torchtitan.py fetch`), else this module's imitation of them,
# which tests/system/golden/test_titan.py checks equal to torchtitan's where they are. The optimizer is built as
# torchtitan's `OptimizersContainer` builds it with `implementation="for-loop"` (its default,
# "fused", is CUDA's).

HF_TO_TITAN_03 = {
    **HF_TO_TITAN,
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "lm_head.weight": "lm_head.weight",
}
IMPL = {"fused": False, "foreach": False}  # OptimizersContainer's kwargs for implementation="for-loop"


def to_titan03(hf: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict under torchtitan 0.3's names and row order (the model's
    state dict, fused q/k/v given apart as its hook gives them)."""
    return _renamed(hf, config, HF_TO_TITAN_03, titan_rows, "model.layers.", "q_proj.weight", "k_proj.weight")


def to_hf03(titan: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The inverse of `to_titan03`."""
    back = {v: k for k, v in HF_TO_TITAN_03.items()}
    return _renamed(titan, config, back, hf_rows, "layers.", "qkv_linear.wq.weight", "qkv_linear.wk.weight")


def qkv_rows(heads: int, kv: int, head_dim: int) -> list[torch.Tensor]:
    """Which rows of the fused wqkv are wq's, wk's and wv's, in their order: per kv head g, the
    heads / kv q heads of its group, then k head g, then v head g (torchtitan 0.3's layout)."""
    per = heads // kv
    rows: list[list[int]] = [[], [], []]
    for g in range(kv):
        at = g * (per + 2) * head_dim
        rows[0] += range(at, at + per * head_dim)
        rows[1] += range(at + per * head_dim, at + (per + 1) * head_dim)
        rows[2] += range(at + (per + 1) * head_dim, at + (per + 2) * head_dim)
    return [torch.tensor(r) for r in rows]


def split_fused(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Imitation of `FusedQKVLinear._split_qkv_on_save`: the fused weight given as wq, wk, wv."""
    key = prefix + "wqkv.weight"
    if key in state_dict:
        fused = state_dict.pop(key)
        fused = fused.full_tensor() if isinstance(fused, DTensor) else fused
        heads = module.heads_per_kv * fused.shape[0] // (module.r_dim * module.head_dim)
        for name, rows in zip(("wq", "wk", "wv"), qkv_rows(heads, heads // module.heads_per_kv, module.head_dim)):
            state_dict[f"{prefix}{name}.weight"] = fused.index_select(0, rows)


def merge_fused(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Imitation of `FusedQKVLinear._merge_qkv_on_load`: wq, wk, wv fused back."""
    keys = [f"{prefix}{name}.weight" for name in ("wq", "wk", "wv")]
    if all(k in state_dict for k in keys):
        parts = [state_dict.pop(k) for k in keys]
        kv = parts[1].shape[0] // module.head_dim
        fused = torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=parts[0].dtype)
        for part, rows in zip(parts, qkv_rows(module.heads_per_kv * kv, kv, module.head_dim)):
            fused[rows] = part
        state_dict[prefix + "wqkv.weight"] = fused


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Imitation of `init_optim_state`: the optimizer's state made by a zero-gradient, zero-lr step."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def flat_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Imitation of `get_flat_optim_state_dict`: the state dict keyed by parameter names, flat."""
    saved = optimizer.state_dict()
    flat: dict[str, Any] = {}
    for group in saved["param_groups"]:
        for index, name in zip(group["params"], group["param_names"]):
            flat.update({f"state.{name}.{k}": v for k, v in saved["state"].get(index, {}).items()})
            flat.update({f"param_groups.{name}.{k}": v for k, v in group.items() if k not in ("params", "param_names")})
    return flat


def load_flat_state(optimizer: torch.optim.Optimizer, flat: dict[str, Any]) -> None:
    """Imitation of `load_flat_optim_state_dict`: `flat_state`'s dict loaded (the state made first)."""
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        names = group["param_names"]
        for name, p in zip(names, group["params"]):
            state[index] = {k: flat[f"state.{name}.{k}"] for k in optimizer.state[p]}
            index += 1
        keys = [k for k in group if k not in ("params", "param_names")]
        ids = list(range(index - len(names), index))
        groups.append({"params": ids, **{k: flat[f"param_groups.{names[0]}.{k}"] for k in keys}})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


class TitanCode(NamedTuple):
    """The state-dict code of torchtitan 0.3 the helpers run: its own, or the imitation above."""

    split: Callable
    merge: Callable
    init_state: Callable
    flat_state: Callable
    load_flat_state: Callable
    whose: str


def titan03_code() -> TitanCode:
    """torchtitan 0.3's own hooks and optimizer functions where its files are here, else the imitation."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from check_torchtitan import fused_qkv_hooks, optimizer_utils, torchtitan_03_root

    root = torchtitan_03_root()
    if root is None:
        return TitanCode(split_fused, merge_fused, init_state, flat_state, load_flat_state, "imitation")
    split, merge = fused_qkv_hooks(root)
    utils = optimizer_utils(root)
    return TitanCode(
        split,
        merge,
        utils.init_optim_state,
        utils.get_flat_optim_state_dict,
        utils.load_flat_optim_state_dict,
        f"torchtitan's own ({root})",
    )


class _QKV(nn.Module):
    """`qkv_linear`: torchtitan 0.3's `FusedQKVLinear` (one `wqkv`, with its state-dict hooks), or
    its `QKVLinear` (wq, wk, wv)."""

    def __init__(self, h: int, heads: int, kv: int, d: int, code: TitanCode | None):
        super().__init__()
        if code is None:
            self.wq, self.wk, self.wv = (nn.Linear(h, n * d, bias=False) for n in (heads, kv, kv))
            return
        self.wqkv = nn.Linear(h, (heads + 2 * kv) * d, bias=False)
        self.head_dim, self.heads_per_kv, self.r_dim = d, heads // kv, heads // kv + 2
        self.register_state_dict_post_hook(code.split)
        self.register_load_state_dict_pre_hook(code.merge)


class _Attention03(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, d: int, code: TitanCode | None):
        super().__init__()
        self.qkv_linear = _QKV(h, heads, kv, d, code)
        self.wo = nn.Linear(heads * d, h, bias=False)


class _Block03(nn.Module):
    def __init__(self, cfg: dict, code: TitanCode | None):
        super().__init__()
        h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.attention = _Attention03(h, cfg["num_attention_heads"], cfg["num_key_value_heads"], d, code)
        self.attention_norm = _Norm(h)
        self.feed_forward = _FeedForward(h, cfg["intermediate_size"])
        self.ffn_norm = _Norm(h)


class TitanLlama03(nn.Module):
    """Parameters named as torchtitan 0.3's llama3 `Llama3Model` (no forward needed), q/k/v fused
    (`code`: the hooks) or not (None)."""

    def __init__(self, cfg: dict, code: TitanCode | None):
        super().__init__()
        h = cfg["hidden_size"]
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleDict({str(i): _Block03(cfg, code) for i in range(cfg["num_hidden_layers"])})
        self.norm = _Norm(h)
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)


def titan03_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """AdamW as torchtitan 0.3's `OptimizersContainer` builds it: one group, the parameters' names in it."""
    names, params = zip(*model.named_parameters())
    return torch.optim.AdamW([{"params": list(params), "param_names": list(names), **IMPL, **HYPER}])


def titan03_state(hf: dict[str, torch.Tensor], config: dict, fused: bool, steps: int = 2, seed: int = 0) -> dict:
    """A torchtitan 0.3 training state (as `titan_state`): the HF weights loaded into 0.3's model
    (through the fused module's load hook when `fused`), `steps` AdamW steps on seeded gradients;
    "model" is the model's state dict (the fused weight given apart by its hook), "optimizer" the
    state per parameter name (the fused parameter's under `qkv_linear.wqkv.weight`)."""
    torch.manual_seed(seed)
    code = titan03_code()
    model = TitanLlama03(config, code if fused else None)
    model.load_state_dict(to_titan03(hf, config))
    optimizer = titan03_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup, steps=10))
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    state = optimizer.state_dict()
    names = state["param_groups"][0]["param_names"]
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {names[i]: {k: v.clone() for k, v in entry.items()} for i, entry in state["state"].items()},
        "hyper": {k: v for k, v in state["param_groups"][0].items() if k not in ("params", "param_names")},
        "lr_scheduler": {"last_epoch": scheduler.last_epoch},
        "train_state": {"step": steps, "ntokens_seen": 1234 * steps},
        "fused": fused,
    }


def titan03_states(model: nn.Module, optimizer: torch.optim.Optimizer, code: TitanCode, step: int) -> dict:
    """What torchtitan 0.3's `CheckpointManager` saves and loads (`_flattened_model_states_sd`): the
    model's state dict at the top, the flat optimizer state, the schedule and train state."""
    code.init_state(optimizer)
    return {
        **model.state_dict(),
        "optimizer": code.flat_state(optimizer),
        "lr_scheduler": {"last_epoch": step},
        "train_state": {"step": step, "ntokens_seen": 1234 * step},
    }


def _worker03(rank: int, world: int, port: int, state_path: str, config: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = json.loads(Path(config).read_text())
        full = torch.load(state_path, weights_only=True)
        code = titan03_code()
        model = TitanLlama03(cfg, code if full["fused"] else None)
        model.load_state_dict(full["model"])
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = titan03_optimizer(model)
        torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup, steps=10))  # as torchtitan builds it
        code.init_state(optimizer)
        params, flat = dict(model.named_parameters()), {}
        for name, entry in full["optimizer"].items():
            for k, v in entry.items():
                flat[f"state.{name}.{k}"] = distribute_tensor(v, mesh, params[name].placements) if v.dim() else v
            flat.update({f"param_groups.{name}.{k}": v for k, v in full["hyper"].items()})
        code.load_flat_state(optimizer, flat)
        states = titan03_states(model, optimizer, code, full["train_state"]["step"])
        states["lr_scheduler"], states["train_state"] = full["lr_scheduler"], full["train_state"]
        states["dataloader"] = {f"dp_rank_{rank}": {"sample_idx": 17 + rank}}
        dcp.save(states, checkpoint_id=out)
    finally:
        dist.destroy_process_group()
    exit_saved()


def build03(out: Path, state_path: Path, config: Path, world: int = 2) -> None:
    """Save the torchtitan 0.3 state of `state_path` (`titan03_state`) as torchtitan 0.3 does, its
    model sharded by FSDP2 over `world` gloo processes, into the DCP folder `out`."""
    import torch.multiprocessing as mp

    _preload()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _worker03, args=(world, port, str(state_path), str(config), str(out)), nprocs=world, start_method="fork"
    )


if __name__ == "__main__":
    if sys.argv[5:] == ["--0.3"]:
        build03(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
    else:
        build(
            Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["--model-only"]
        )
