"""torchtitan-shaped DCP checkpoints, written by torch's own DCP from a model sharded with FSDP2.

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
from pathlib import Path

import torch
from torch import nn

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


def _renamed(state: dict[str, torch.Tensor], config: dict, table: dict[str, str], rows, prefix: str,
             q: str, k: str) -> dict[str, torch.Tensor]:
    """`state` under `table`'s names ({} = the layer index after `prefix`), q and k rows by `rows`."""
    out = {}
    for key, value in state.items():
        layer = key[len(prefix):].split(".")[0] if key.startswith(prefix) else None
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
        self.wq, self.wk, self.wv = nn.Linear(h, q, bias=False), nn.Linear(h, kv, bias=False), nn.Linear(h, kv, bias=False)
        self.wo = nn.Linear(q, h, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False), nn.Linear(h, i, bias=False)


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
            torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup, steps=10))  # as torchtitan builds it
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


def build(out: Path, state_path: Path, config: Path, world: int = 2, model_only: bool = False) -> None:
    """Save the state of `state_path` (`titan_state`) as torchtitan does, by FSDP2 over `world`
    gloo processes, into the DCP folder `out`."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, str(state_path), str(config), str(out), model_only), nprocs=world)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["--model-only"])
