"""NxD's replica groups, recorded by running NxD's own `parallel_state` (no shardkit import here).

neuronx-distributed is not on PyPI (its name there is an empty placeholder) and needs torch-xla,
torch-neuronx and the Neuron compiler, so its group construction cannot run in CI. This script
runs it once, here, and writes what it builds to fixtures/nxd-replica-groups/groups.json, which
tests/unit/trainer/test_trainer_groups.py compares the trainer's groups with (that folder's README says from
which NxD commit).

It executes NxD's `src/neuronx_distributed/parallel_layers/parallel_state.py` and
`src/neuronx_distributed/utils/utils.py` (the `hardware` enum) unchanged, from a checkout of
aws-neuron/neuronx-distributed, with stand-ins only for what lives outside them: torch-xla
(`mark_step`, unused here), torch-neuronx's `get_platform_target` (returns the case's platform,
as it does on that instance), the compiler's `CollectivesConfig` (context parallelism's ring pairs,
unused by the trainer), NxD's logger and `cpu_mode` (False: the XLA path), and torch.distributed's
rank, world size and `new_group` (a group that knows its ranks and its rank in them, sorted as
torch's are). For every case and every rank, `initialize_model_parallel(tp, pp, ep,
skip_collective_init=True)` runs in a fresh copy of the module (and `initialize_kv_group` where the
case has a kv size); the groups are read back with NxD's own getters (`get_*_group(as_list=True)`,
the lists NxD passes to xm's collectives), and each rank's coordinates with NxD's `get_*_rank`.

    python tests/support/nxd_groups_ref.py record NXD_CHECKOUT NXD_COMMIT [OUT_JSON]

NXD_CHECKOUT holds the two files at their repository paths (`git archive NXD_COMMIT <paths>` of
a clone is enough); NXD_COMMIT is written into the JSON.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

OUT = Path(__file__).resolve().parents[2] / "fixtures" / "nxd-replica-groups" / "groups.json"
STATE = "src/neuronx_distributed/parallel_layers/parallel_state.py"
HARDWARE = "src/neuronx_distributed/utils/utils.py"

KEYS = ("platform", "lnc", "local_world_size", "tp", "pp", "dp", "ep", "kv")
# name -> (platform, lnc_size, LOCAL_WORLD_SIZE or None, tp, pp, dp, ep, kv_shared_group_size)
CASES: dict[str, tuple[str, int, int | None, int, int, int, int, int]] = {
    # NxD's generic layout ("LOGIC1"): the ranks reshaped to [pp, dp, tp] ([pp, edp, ep, tp] for experts)
    "tp2-pp2-dp2": ("trn1", 1, None, 2, 2, 2, 1, 1),
    "tp2-dp4-ep2": ("trn1", 1, None, 2, 1, 4, 2, 1),
    "tp4-pp2-dp2-trn2": ("trn2", 2, None, 4, 2, 2, 1, 2),
    "tp8-pp4": ("trn1", 1, None, 8, 4, 1, 1, 2),
    "tp8-pp2-dp2-ep2-trn2": ("trn2", 2, None, 8, 2, 2, 2, 1),
    "tp32-trn2-32-ranks": ("trn2", 2, None, 32, 1, 1, 1, 1),  # LNC 2 on fewer than 64 ranks: generic
    # Trn1 with tp 4: strided tp groups inside each node of LOCAL_WORLD_SIZE ranks
    "trn1-tp4-dp8": ("trn1", 1, None, 4, 1, 8, 1, 1),
    "trn1-tp4-pp2-dp4-lws16": ("trn1", 1, 16, 4, 2, 4, 1, 1),
    "trn1-tp4-pp2-dp8-lws32": ("trn1", 1, 32, 4, 2, 8, 1, 1),
    "trn1-tp4-dp2": ("trn1", 1, 8, 4, 1, 2, 1, 1),
    "trn1-tp4-pp2-dp4": ("trn1", 1, None, 4, 2, 4, 1, 1),  # NxD cannot: dp 4 < the 8 tp rows of a node
    "trn1-tp4-dp2-ep2": ("trn1", 1, None, 4, 1, 2, 2, 1),  # NxD: not implemented
    # Trn2 "LOGIC2" (get_logic_chosen): tp 32 at LNC 2, tp 64 at LNC 1
    "trn2-lnc2-tp32-dp2": ("trn2", 2, 64, 32, 1, 2, 1, 1),
    "trn2-lnc2-tp32-pp2": ("trn2", 2, 64, 32, 2, 1, 1, 1),
    "trn2-lnc2-tp32-pp2-dp2": ("trn2", 2, 64, 32, 2, 2, 1, 1),
    "trn2-lnc2-tp32-dp2-lws32": ("trn2", 2, 32, 32, 1, 2, 1, 1),  # one tp group per node: rows 0, 3, 1, 2
    "trn2-lnc1-tp64-dp2": ("trn2", 1, 128, 64, 1, 2, 1, 1),
}

GROUPS = {  # fixture key -> NxD's getter of the group list
    "tp": "get_tensor_model_parallel_group",
    "dp": "get_data_parallel_group",
    "pp": "get_pipeline_model_parallel_group",
    "ep": "get_expert_model_parallel_group",
    "edp": "get_expert_data_parallel_group",
}
COORDS = {  # per rank, NxD's getter of its place
    "dp": "get_data_parallel_rank",
    "pp": "get_pipeline_model_parallel_rank",
    "tp": "get_tensor_model_parallel_rank",
    "ep": "get_expert_model_parallel_rank",
    "edp": "get_expert_data_parallel_rank",
}


class FakeGroup:
    """torch.distributed's group as NxD sees it: its ranks (sorted, as torch numbers them)."""

    def __init__(self, ranks: list[int], mesh: list[list[int]] | None):
        self.ranks, self.mesh = sorted(ranks), mesh


class World:
    """The torch.distributed calls NxD makes, for one rank of `size`."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def get_rank(self, group: FakeGroup | None = None) -> int:
        return self.rank if group is None else group.ranks.index(self.rank)

    def get_world_size(self, group: FakeGroup | None = None) -> int:
        return self.size if group is None else len(group.ranks)

    def new_group(self, ranks: list[int], pg_options: dict | None = None, **_: Any) -> FakeGroup:
        return FakeGroup(ranks, (pg_options or {}).get("xla_pg_options", {}).get("mesh"))


def _module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    if package:
        mod.__path__ = []
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def install_stand_ins(checkout: Path, platform: list[str]) -> None:
    """Modules parallel_state imports, as stand-ins (the real `hardware` enum); `platform[0]` is
    what get_platform_target returns."""
    _module("torch_xla", package=True)
    _module("torch_xla.core", package=True)
    _module("torch_xla.core.xla_model", mark_step=lambda: None)
    _module("torch_xla.runtime")
    _module("torch_neuronx", package=True)
    _module("torch_neuronx.utils", get_platform_target=lambda: platform[0])
    for name in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki._private_kernels"):
        _module(name, package=True)
    _module(
        "neuronxcc.nki._private_kernels.collectives",
        CollectivesConfig=lambda replica_groups: types.SimpleNamespace(rank_src_tgt_pairs=defaultdict(type(None))),
    )
    _module("neuronx_distributed", package=True)
    _module("neuronx_distributed.parallel_layers", package=True)
    _module("neuronx_distributed.utils", package=True, cpu_mode=lambda: False)
    _module("neuronx_distributed.utils.logger", get_logger=lambda *a, **k: logging.getLogger("nxd"))
    utils = _module("neuronx_distributed.utils.utils")
    exec(compile((checkout / HARDWARE).read_text(), str(checkout / HARDWARE), "exec"), utils.__dict__)


def run(code: Any, world: World, case: tuple) -> types.ModuleType:
    """A fresh parallel_state, initialized for `world`'s rank in `case`."""
    _, lnc, local_world, tp, pp, dp, ep, kv = case
    mod = types.ModuleType("neuronx_distributed.parallel_layers.parallel_state")
    mod.__package__ = "neuronx_distributed.parallel_layers"
    exec(code, mod.__dict__)
    if local_world is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    mod.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        skip_collective_init=True,
        lnc_size=lnc,
    )
    if kv > 1:
        mod.initialize_kv_group(kv)
    return mod


def record(checkout: Path) -> dict:
    platform = ["trn1"]
    install_stand_ins(checkout, platform)
    code = compile((checkout / STATE).read_text(), str(checkout / STATE), "exec")
    saved = {k: getattr(dist, k) for k in ("is_initialized", "get_rank", "get_world_size", "new_group", "ProcessGroup")}
    out = {}
    try:
        for name, case in CASES.items():
            platform[0] = case[0]
            _, _, _, tp, pp, dp, ep, kv = case
            size = tp * pp * dp
            entry: dict[str, Any] = dict(zip(KEYS, case)) | {"world": size}
            coords = []
            for rank in range(size):
                world = World(rank, size)
                stand_ins = {"is_initialized": lambda: True, "ProcessGroup": FakeGroup, "get_rank": world.get_rank}
                stand_ins |= {"get_world_size": world.get_world_size, "new_group": world.new_group}
                for attr, value in stand_ins.items():
                    setattr(dist, attr, value)
                try:
                    mod = run(code, world, case)
                except Exception as e:  # noqa: BLE001 - what NxD does with this layout
                    entry["error"] = f"{type(e).__name__}: {e}"
                    break
                if rank == 0:
                    entry["logic"] = mod._REPLICA_LOGIC.name
                    entry["groups"] = {k: getattr(mod, g)(as_list=True) for k, g in GROUPS.items()}
                    if pp > 1:  # rank 0 is pp rank 0: its next groups pair even stages with the next
                        entry["groups"]["pp_next"] = mod.get_next_rank_group(as_list=True)
                        entry["groups"]["pp_prev"] = mod.get_prev_rank_group(as_list=True)
                    if kv > 1:
                        entry["groups"]["kv"] = mod.get_kv_shared_group(as_list=True)
                coords.append({k: getattr(mod, g)() for k, g in COORDS.items()})
            if "error" not in entry:
                entry["coords"] = coords
            out[name] = entry
    finally:
        for k, v in saved.items():
            setattr(dist, k, v)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "record":
        print(__doc__, file=sys.stderr)
        return 2
    checkout, commit = Path(argv[1]), argv[2]
    target = Path(argv[3]) if len(argv) > 3 else OUT
    cases = record(checkout)
    target.parent.mkdir(parents=True, exist_ok=True)
    made = {"nxd_commit": commit, "files": [STATE, HARDWARE], "torch": torch.__version__, "cases": cases}
    target.write_text(json.dumps(made, separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases -> {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
