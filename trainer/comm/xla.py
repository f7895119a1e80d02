"""The communication interface on torch-xla (Trainium through the Neuron SDK; CPU for testing).

Collectives are torch-xla's, called as NxD calls them (`parallel_layers/comm.py`, `mappings.py`):
with the list of every group of the kind as replica groups (a "mesh"), all-gather and
reduce-scatter with unpinned layouts. Work is traced; a rank runs what it traced when it cuts the
graph (`XlaComm.cut`: after each micro-batch or pipeline tick, and at the end of a step).

Two ways to run a job:

- one process per device under torchrun (Trainium: `PJRT_DEVICE=NEURON`): torch.distributed's
  "xla" process group, and a gloo group beside it for the host side (NxD keeps one for objects);
- several devices in one process, one rank per device, each a thread (`threads.py`; torch-xla's
  only multi-device mode on CPU). XLA runs their collectives in process, and that runtime asks
  for five things: collectives of separately compiled graphs meet only when they carry the same
  channel id, so each gets one (per family of groups, counted from the last cut; torch-xla's
  all-reduce takes none, so here it is an all-gather and a sum); replica groups must name every
  device (each mesh is completed with the ranks it leaves out); enough threads to run every
  device's graph at once (`runtime_for_threads`); no device may wait more than 10 s in a
  collective (the process stops), so after a barrier the ranks compile and launch one at a time
  -- ranks that traced the same graph share the compile and start together -- and graphs with
  collectives are the same on all their ranks or small (`Comm.isolate`); and no buffer a running
  graph holds may be freed while the GIL or that turn is held (that waits for the graph), so each
  rank waits for its graph before it goes on, and buffers are not donated to graphs (torch-xla
  would release a donated one inside the launch: `runtime_for_threads`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardkit.distributed import Job

from ..errors import TrainerError
from .base import Comm, Group
from .threads import RankThread, current

log = logging.getLogger("trainer")
_COMPILE = threading.Lock()
TRACE_CUTS = bool(os.environ.get("TRAINER_TRACE_CUTS"))  # log every graph cut of a threaded job (diagnostics)

CHANNEL_STRIDE = 1 << 20  # channel id = (family index + 1) * stride + the family's collectives since the cut


def _xm():
    import torch_xla.core.xla_model as xm

    return xm


class Channels:
    """Channel ids of one threaded rank: per family of groups, the collectives since the last cut."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def next(self, family: int) -> int:
        count = self.counts.get(family, 0)
        self.counts[family] = count + 1
        return (family + 1) * CHANNEL_STRIDE + count

    def reset(self) -> None:
        self.counts.clear()


class XlaGroup(Group):
    """Collectives over `mesh` (every group of this kind, this one among them)."""

    def __init__(self, ranks: list[int], rank: int, mesh: list[list[int]], index: int, channels: Channels | None):
        super().__init__(ranks, rank)
        self.mesh, self.index, self.channels = mesh, index, channels

    def per_rank(self, value: int, like: torch.Tensor) -> Any:
        # a one-element tensor, not a Python number: torch-xla folds some numbers into the graph
        # (0 and 1), and ranks must trace the same graph to share its compile
        return torch.tensor([value], dtype=like.dtype, device=like.device) if self.channels is not None else value

    def _channel(self) -> int | None:
        return self.channels.next(self.index) if self.channels is not None else None

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        xm = _xm()
        if self.channels is None:
            reduced = xm.all_reduce(xm.REDUCE_SUM if op == "sum" else xm.REDUCE_MAX, tensor, groups=self.mesh)
        else:
            stacked = self._all_gather(tensor.unsqueeze(0))
            reduced = stacked.sum(0) if op == "sum" else stacked.amax(0)
        tensor.copy_(reduced)

    def _all_reduce_many(self, tensors: list[torch.Tensor]) -> None:
        if self.channels is not None:  # threaded: all-reduces are all-gathers here (_all_reduce)
            super()._all_reduce_many(tensors)
            return
        # torch-xla reduces a list in place as one collective of the tensors themselves: no copy
        # into a flat buffer (NxD's bucket_allreduce_gradients calls it so)
        xm = _xm()
        xm.all_reduce(xm.REDUCE_SUM, tensors, groups=self.mesh)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _xm().all_gather(tensor, dim=0, groups=self.mesh, pin_layout=False, channel_id=self._channel())

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        xm = _xm()
        return xm.reduce_scatter(
            xm.REDUCE_SUM,
            tensor,
            scale=1.0,
            scatter_dim=0,
            shard_count=self.size,
            groups=self.mesh,
            pin_layout=False,
            channel_id=self._channel(),
        )


def meshes(sets: list[list[int]], world: int, complete: bool) -> tuple[list[int], list[list[list[int]]]]:
    """The sets as replica-group lists ("families"): sets of one size that share no rank go in one
    list (in order), and with `complete` each list is filled up with the ranks it leaves out, cut
    into groups of that size (XLA's CPU runtime wants every device named). Returns each set's
    family index and the families."""
    families: list[tuple[set[int], list[list[int]]]] = []
    where: list[int] = []
    for ranks in sets:
        for i, (used, family) in enumerate(families):
            if len(family[0]) == len(ranks) and used.isdisjoint(ranks):
                used.update(ranks)
                family.append(ranks)
                where.append(i)
                break
        else:
            families.append((set(ranks), [ranks]))
            where.append(len(families) - 1)
    out = []
    for used, family in families:
        mesh = [list(g) for g in family]
        rest = [r for r in range(world) if r not in used]
        size = len(family[0])
        if complete and rest:
            if len(rest) % size:
                raise TrainerError(
                    f"groups {family} of {size} ranks cannot name all {world} devices in replica groups of one size "
                    "(XLA's CPU runtime needs that): choose a layout whose groups divide the ranks evenly"
                )
            mesh += [rest[i : i + size] for i in range(0, len(rest), size)]
        out.append(mesh)
    return where, out


class XlaComm(Comm):
    """torch-xla collectives; `thread` when ranks are threads of this process, else one process per
    device with `host` a gloo group (None for one process) for the host side."""

    name = "xla"
    lazy = True
    accumulate_dtype = torch.float32
    keeps_order = True  # NxD's replica groups are lists: a rank's place in one is its coordinate (parallel.py)

    def __init__(self, rank: int, world: int, device: torch.device, thread: RankThread | None = None, host: Any = None):
        super().__init__(rank, world, device)
        self.thread, self.host = thread, host
        self.channels = Channels() if thread is not None and world > 1 else None
        self._families_made = 0
        self._job = thread.new_job() if thread is not None else Job(rank, world, host) if world > 1 else Job(rank, 1)

    @property
    def job(self) -> Job:
        return self._job

    @property
    def _real_device(self) -> str:
        """This rank's device as the runtime names it ("CPU:1")."""
        import torch_xla

        return torch_xla._XLAC._xla_real_devices([str(self.device)])[0]

    def barrier(self) -> None:
        if self.world == 1:
            return
        if self.thread is not None:
            self._job.gather(None)
        else:
            import torch.distributed as dist

            dist.barrier(group=self.host)

    def _make_groups(self, sets: list[list[int]]) -> dict[frozenset, Group]:
        made: dict[frozenset, Group] = {}
        several = [s for s in sets if len(s) > 1]
        where, families = meshes(several, self.world, complete=self.thread is not None)
        for ranks, family in zip(several, where):
            # one channel series per family (its groups share no device): the groups of a family,
            # and so the ranks in the same place of each, trace the same graph and share its compile
            index = self._families_made + family
            if self.rank in ranks:
                made[frozenset(ranks)] = XlaGroup(ranks, ranks.index(self.rank), families[family], index, self.channels)
        self._families_made += len(families)
        return made

    def cut(self) -> None:
        import torch_xla

        if self.channels is None:
            torch_xla.sync()
            return
        # A threaded job (module docstring). Every rank has traced its graph; one at a time they
        # compile and launch it (ranks that traced the same graph find it compiled, and launch
        # together); then each waits for its graph without holding the GIL or that lock, as peers
        # still have to launch theirs. Only then is the collectives' token dropped (what
        # torch_xla.sync() does at once): freeing a buffer a running graph holds waits for the
        # graph, with the GIL held, and no peer could launch anything meanwhile.
        self._job.gather(None)
        device = torch_xla._XLAC._xla_get_default_device()
        with _COMPILE:
            start = time.perf_counter()
            torch_xla._XLAC._xla_step_marker(device, [], wait=False, reset_scope=True)
            launched = time.perf_counter() - start
        torch_xla._XLAC._xla_wait_device_ops([self._real_device])
        if TRACE_CUTS:
            caller = next(f for f in reversed(traceback.extract_stack()) if os.sep + "comm" + os.sep not in f.filename)
            log.warning(
                "rank %d: graph cut at %s:%d compiled and launched in %.2f s, ran in %.2f s",
                self.rank,
                Path(caller.filename).name,
                caller.lineno,
                launched,
                time.perf_counter() - start - launched,
            )
        torch_xla._XLAC._set_all_reduce_token(device, None)
        self.channels.reset()

    def isolate(self) -> None:
        if self.channels is not None:
            self.cut()

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch_xla

        on_device = [t for t in tensors if t.device.type == "xla"]
        if not on_device:
            return [t.cpu() for t in tensors]
        moved = iter(torch_xla._XLAC._xla_get_cpu_tensors(on_device))
        return [next(moved) if t.device.type == "xla" else t.cpu() for t in tensors]

    @property
    def overlaps_steps(self) -> bool:
        return self.channels is None  # a threaded job's cut waits for its graph (cut)

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # `t.to(device)` makes a 0-dim 0 or 1 a constant of the next graph (torch-xla's special
        # scalars): an Adam step count of 0 would be an output of a fresh run's first graph and not
        # of a resumed one's; uploaded as data, the graphs are the same
        import torch_xla

        if not tensors:
            return []
        return list(
            torch_xla._XLAC._xla_tensors_from_aten([t.cpu() for t in tensors], [str(self.device)] * len(tensors))
        )

    def compiles(self) -> int | None:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        # torch-xla's own: an optimization barrier keeps XLA from merging the recomputation with
        # the forward (common-subexpression elimination would undo the checkpointing)
        from torch_xla.utils.checkpoint import checkpoint

        return checkpoint(function, *args)

    @property
    def shares_process(self) -> bool:
        return self.thread is not None and self.world > 1

    def checkpointer_job(self) -> Job | None:
        return self.thread.new_job() if self.thread is not None else None


# ---- joining -----------------------------------------------------------------------------------------


def xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def runtime_type() -> str:
    """The PJRT runtime's device type ("CPU", "NEURON", "CUDA", "TPU"), from PJRT_DEVICE or, unset,
    as torch-xla picks it."""
    import torch_xla.runtime as xr

    return str(xr.device_type() or os.environ.get("PJRT_DEVICE", "")).upper()


def runtime_for_threads(devices: int) -> None:
    """The runtime's settings for `devices` ranks as threads of this process; set before the first
    graph runs. torch-xla runs graphs on a pool of hardware_concurrency threads
    (XLA_THREAD_POOL_SIZE); with more devices than that, the ranks' graphs wait for each other in
    collectives inside a full pool and never finish. And a graph that updates a tensor in place
    takes over (is donated) its old buffer, which torch-xla then releases inside the launch, waiting
    for the graph: with ranks launching one at a time, a graph waiting in a collective for a peer
    that cannot launch yet. So with several devices buffers are not donated
    (XLA_ENABLE_PARAM_ALIASING=0: more device memory, the same results)."""
    wanted = max(devices * 2, os.cpu_count() or 1)
    current_size = int(os.environ.get("XLA_THREAD_POOL_SIZE", "0") or 0)
    if current_size < devices * 2:
        os.environ["XLA_THREAD_POOL_SIZE"] = str(wanted)
    if devices > 1:
        os.environ["XLA_ENABLE_PARAM_ALIASING"] = "0"


def local_devices() -> int:
    """How many XLA devices this process has (CPU_NUM_DEVICES on CPU)."""
    import torch_xla.runtime as xr

    return xr.addressable_device_count()


def thread_devices() -> list[Any]:
    """Make this process's devices one replicated job (what xmp.spawn does before its threads) and
    return them."""
    import torch_xla.core.xla_model as xm
    from torch_xla._internal import pjrt

    pjrt.initialize_multiprocess(0, 1)
    return xm.get_xla_supported_devices()


def enter_device(device: Any) -> None:
    """Make `device` this thread's default XLA device (as xmp.spawn's threads do)."""
    import torch_xla

    torch_xla._XLAC._xla_set_default_device(device)


def join_xla(device: torch.device | None, rank: int, world: int, timeout_s: float) -> Comm:
    """This rank's XlaComm: a thread of a threaded job, or a process under torchrun (the "xla"
    process group -- `import torch_xla` registers it -- with a gloo group for the host side)."""
    me = current()
    if me is not None:
        return XlaComm(me.rank, me.world.size, device or torch.device("cpu"), thread=me)
    if world == 1:
        return XlaComm(0, 1, device or torch.device("cpu"))
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s if timeout_s > 0 else 600.0)
    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    host = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    return XlaComm(rank, world, device or torch.device("cpu"), host=host)
