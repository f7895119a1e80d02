"""NxD's zero1-dcp optimizer layout, written the way NxD 2.29 writes it, by torch's own DCP.

`save_like_nxd(tag, tp, dp)` turns a tag whose optimizer is in NxD's per-rank ZeRO-1 files
(`optim/dp_rank_DD_tp_rank_TT_pp_rank_00.pt`, one param group, pp 1) into what
`save_checkpoint(..., use_zero1_dcp=True)` leaves: each rank's ZeRO-1 state dict wrapped as
`neuronx_distributed/optimizer/zero_dcp_utils.py::_wrap_optim_state_dict` wraps it, then saved by
`torch.distributed.checkpoint.save` in a gloo job of tp x dp processes (NxD calls the same
planner and `FileSystemWriter` by hand with every rank's plan; the files are the same). Written
from NxD's code, not from shardkit's:

- `base_state` keyed by parameter name (`model.named_parameters()` of the stage; with one group
  the optimizer's index is the parameter's position);
- the state dict flattened by torch's `flatten_state_dict`, every tensor of more than 0 dims
  made a ShardedTensor over the dp group of global size `shape_info[idx]` (the tp-local shape):
  rank d's chunk at row d * rows, the last rank's padding cut off; its key's last element gets
  `|tp-TTTT` (tp > 1), as `|pp-PPPP` would for pp > 1;
- scalars (`step`) stay plain tensors; everything else is plain data.

One deviation, which does not reach the files: NxD names each ShardedTensor shard's placement
`rank:<dp rank>`, which torch reads as a global rank (and refuses for tp > 1); here each shard is
placed on its real global rank. DCP stores only chunk offsets and sizes, not placements.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from titan_dcp import exit_saved


def _sharded(tensor: torch.Tensor, shape: list[int], d: int, dp: int, tp: int, t: int, group):
    """NxD's `_tensor_to_sharded_tensor`, placements by global rank."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

    if tensor.dim() == 0:
        return tensor
    each = tensor.shape[0]  # rows of every padded dp shard
    padding = each * dp - shape[0]
    if d == dp - 1 and padding:
        tensor = tensor[: each - padding].clone()
    rows = [each] * (dp - 1) + [each - padding]
    starts = [sum(rows[:i]) for i in range(dp)]
    rest = list(tensor.shape[1:])
    metadata = [
        ShardMetadata([s] + [0] * len(rest), [r] + rest, f"rank:{i * tp + t}/cpu")
        for i, (s, r) in enumerate(zip(starts, rows))
    ]
    props = TensorProperties(
        dtype=tensor.dtype,
        layout=tensor.layout,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    global_md = ShardedTensorMetadata(metadata, torch.Size(shape), props)
    local = [Shard.from_tensor_and_offsets(tensor, [starts[d]] + [0] * len(rest), d * tp + t)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, sharded_tensor_metadata=global_md, process_group=group
    )


def _wrap(obj: dict, names: list[str], d: int, dp: int, tp: int, t: int, group) -> dict:
    """NxD's `_wrap_optim_state_dict` for pp 1 and one param group."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    pid_to_name = dict(enumerate(names))
    name_to_pid = {v: k for k, v in pid_to_name.items()}
    state = dict(obj)
    state["base_state"] = {pid_to_name[k]: v for k, v in obj["base_state"].items()}
    shape_info = state["shape_info"]
    flat, mappings = flatten_state_dict(state)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            pname = mappings[key][1]
            flat[key] = _sharded(value, shape_info[name_to_pid[pname]], d, dp, tp, t, group)
            if value.dim() > 0:
                last = str(mappings[key][-1]) + (f"|tp-{t:04d}" if tp > 1 else "")
                mappings[key] = (*mappings[key][:-1], last)
    return unflatten_state_dict(flat, mappings)


def _worker(rank: int, world: int, port: int, tag: str, tp: int, dp: int) -> None:
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t, d = rank % tp, rank // tp
        groups = [dist.new_group([i * tp + tt for i in range(dp)]) for tt in range(tp)]
        root = Path(tag)
        obj = torch.load(root / f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True)
        model = torch.load(root / f"model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True)
        assert len(obj["param_groups"]) == 1, "NxD's DCP code handles one param group only"
        dcp.save(_wrap(obj, list(model), d, dp, tp, t, groups[t]), checkpoint_id=str(root / "optim"))
    finally:
        dist.destroy_process_group()
    exit_saved()


def save_like_nxd(tag: Path, tp: int, dp: int) -> None:
    """Replace `tag`'s per-rank optimizer files by NxD's zero1-dcp layout (see the module's doc)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.distributed.checkpoint  # noqa: F401  (imported once, before the workers are forked)

    mp.start_processes(_worker, args=(tp * dp, port, str(tag), tp, dp), nprocs=tp * dp, start_method="fork")
    for f in (Path(tag) / "optim").glob("dp_rank_*.pt"):
        f.unlink()


if __name__ == "__main__":
    save_like_nxd(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
