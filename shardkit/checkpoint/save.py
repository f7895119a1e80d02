"""Saving a training checkpoint: each rank writes only its own files, markers around them.

One save, on every rank of the job (steps 2-5 run in the background thread for async saves):
1. (caller's thread) check this rank's state against the layout, copy it to host memory when
   async, and agree with the other ranks that every (tp, pp, ep) rank is held by one process
   (dp 0); an error on any rank fails the save on every rank before anything is written;
2. rank 0 creates `<tag>/` (removing an older tag of the same name, `done` first) and writes the
   `checkpoint` marker, durably; barrier;
3. every rank with dp 0 writes its model and optimizer files with the format's writer, fsyncs
   them and their folders; global rank 0 also writes config.json, scheduler.pt, user_content.pt;
   the ranks exchange their file records;
4. rank 0 writes the manifest (shardkit.json), fsyncs it and the folder, then writes `done`,
   durably; the ranks agree that it was written;
5. rank 0 applies retention (after `done`, never before; failures logged, not raised).

One writer per directory: before step 2, rank 0 (only it: the ranks of one job share the folder)
takes the directory's lock (`<dir>/.shardkit.lock`, tree.lock_directory) and keeps it until step
5 is over, also when steps 2-5 run in the background; a second job saving or pruning meanwhile
gets CheckpointLockedError naming the holder, on every rank of its job, before anything is written.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from typing_extensions import Unpack

from ..distributed import Job
from ..errors import LayoutError, ShardkitError
from ..families import Family, family_for
from ..formats import MANIFEST, get_format, load_config
from ..formats.base import TensorSpec
from ..formats.manifest import file_record
from ..formats.manifest import manifest as build_manifest
from ..formats.torch_io import save_file
from ..formats.torch_zip import ARCHIVE
from ..io.data.buffers import one_torch_thread
from ..io.data.digest import FileRecord, Recording
from ..io.data.hashing import HashingFile
from ..io.location import remote as remote_location
from ..io.safety.delete import is_link
from ..io.safety.durable import fsync_path, write_text
from ..io.safety.oserror import disk_error, translated
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.transaction import refuse_link, terminate_as_interrupt
from ..layout import Layout, ModelDims
from .async_save import BackgroundWriter, HostStaging, host_copy
from .base import (
    CheckpointerConfig,
    CheckpointError,
    CheckpointWriteError,
    Rank,
    check_format,
    check_retention,
    distributed_rank,
    jsonable,
)
from .object_writer import save_object, save_together
from .state import (
    RankState,
    check_plain,
    is_rank_mapping,
    model_file,
    normalize_optimizer,
    optim_file,
    rank_state,
    scheduler_state,
)
from .tree import (
    CONFIG,
    MODEL_DIR,
    SCHEDULER,
    USER_CONTENT,
    DirectoryLock,
    apply_retention,
    is_complete,
    list_checkpoints,
    lock_directory,
    plan_retention,
    tag_folder,
    tag_path,
    tag_step,
)
from .zero1 import build_optim

log = logging.getLogger(__name__)


# ---- rank coordination -----------------------------------------------------------------------------


def make_job(group: Any = None) -> Job:
    """The checkpoint layer's collectives: a `Job` on its own process group (None: one process)."""
    if group is None:
        return Job()
    import torch.distributed as dist

    return Job(dist.get_rank(), dist.get_world_size(), group)


def agree(job: Job, what: str, step: Callable[[], Any], where: Path | None = None) -> list[Any]:
    """`Job.agree` with the checkpoint layer's errors: an OSError here, or any failure elsewhere,
    is a CheckpointWriteError naming what failed."""
    try:
        return job.agree(step, elsewhere=lambda m: CheckpointWriteError(f"{what} failed on another rank ({m})"))
    except OSError as e:
        raise CheckpointWriteError(f"{what} failed: {disk_error(e, 'write', e.filename or where)}") from None


def new_group() -> Any:
    """A dedicated gloo group for checkpoint collectives (None without a multi-process job)."""
    if distributed_rank() is None:
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


# ---- one save ------------------------------------------------------------------------------------


class SaveOptions(TypedDict, total=False):
    """The keyword options of `Checkpointer.save` and `save_checkpoint`."""

    layout: Layout | None
    """The layout the state is cut in; with `config`, the checkpoint can be resharded on load."""
    config: Mapping[str, Any] | str | Path | None
    """The model's Hugging Face config (dict or config.json path)."""
    rank: Any
    """This process's rank: (tp, pp), (ep, tp, pp) or a Rank (default: from torch.distributed)."""
    format: str | None
    """torch, xser or safetensors (default: the Checkpointer's)."""
    async_save: bool | None
    """Write in the background after copying to host memory (default: the Checkpointer's)."""
    num_kept: int | None
    """Retention after `done`: keep the newest N complete tags (None: all; default: the Checkpointer's)."""
    keep_every: int | None
    """Retention: also keep the tags whose step is a multiple of K."""
    step: int | None
    """The training step (default: read from the tag's name or user content)."""
    param_names: Sequence[str] | Mapping[Any, Sequence[str]] | None
    """The piece name of each torch.optim parameter index, when `optimizer_state` is a state_dict."""
    zero1: bool
    """Every dp rank writes its own ZeRO-1 optimizer shard (default False)."""


@dataclass
class SaveRequest:
    """One `Checkpointer.save` call: its state, its options, and the options the Checkpointer's
    defaults decide, resolved."""

    dir: Path
    tag: str
    model_state: Any
    optimizer_state: Any
    scheduler: Any
    user_content: Any
    options: SaveOptions
    fmt: str
    async_save: bool
    num_kept: int | None
    keep_every: int | None

    @property
    def zero1(self) -> bool:
        return bool(self.options.get("zero1", False))


@dataclass
class SaveJob:
    """Everything one save writes from this process, already validated (and copied when async)."""

    root: Path
    tag: str
    layout: Layout | None  # None: a generic checkpoint (any state dicts, no model family)
    fmt: str
    config: dict[str, Any] | None
    family: Family | None
    dims: ModelDims | None
    step: int | None
    ranks: list[RankState]
    leader: bool
    scheduler: Any = None
    user_content: Any = None
    num_kept: int | None = None
    keep_every: int | None = None
    fsync: bool = True
    async_save: bool = False
    world: int = 1
    started: float = 0.0
    records: list[FileRecord] = field(default_factory=list)
    zero1: bool = False
    dp_size: int = 1
    generic: dict[str, Any] | None = None  # generic: {"model": obj or None, "optimizer": obj or None, "dp": d}
    sink: Sink = NO_SINK  # where each finished file goes (`io.safety.sinks`): a save to s3:// uploads it

    @property
    def tag_dir(self) -> Path:
        return self.root / self.tag


def write_tensor_file(
    tag_dir: Path,
    key: str,
    items: list[tuple[str, torch.Tensor]],
    fmt: str,
    expert: set[str],
    fsync: bool,
    sink: Sink = NO_SINK,
) -> list[FileRecord]:
    """One rank file with the format's writer (the one the engine writes with: `formats.registry`);
    durable (file, tensor files, folders) with fsync; each file handed to `sink` as it closes."""
    path = tag_dir / key
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in items]
    experts = [s.name for s in specs if s.name in expert]
    writer = get_format(fmt).writer(path, tag_dir, specs, experts, Recording.FAST, False, sink, ARCHIVE)
    for name, tensor in items:
        writer.write(name, tensor.cpu())
    records = writer.close(fsync=fsync)  # its files durable with fsync (xser: its tensor files too)
    if fsync:
        fsync_path(path.parent)
        fsync_path(path.parent.parent)
    return records


def save_object_hashed(tag_dir: Path, name: str, obj: Any, fsync: bool, sink: Sink = NO_SINK) -> FileRecord:
    """torch.save of plain data (scheduler, user content), hashed and durable, then handed to
    `sink`. Written through `torch_io.save_file`, so a full disk is shardkit's one-line NoSpaceError
    (not torch's "enforce fail") and the partial file is removed; the bytes are torch.save's into a
    file object (records under "archive/")."""
    return save_file(obj, tag_dir / name, tag_dir, sink=sink).close(fsync)


def _save_json(tag_dir: Path, name: str, data: Any, fsync: bool, sink: Sink) -> FileRecord:
    out = HashingFile(tag_dir / name, tag_dir, sink=sink)
    out.write((json.dumps(data, indent=2) + "\n").encode())
    return out.close(fsync)


def prepare_tag(job: SaveJob) -> None:
    """Rank 0: a fresh `<tag>/` with its `checkpoint` marker (an older tag of that name goes first,
    `done` first; a tag that is a symlink loses the link, never its target's files)."""
    with translated("write", job.tag_dir):
        job.root.mkdir(parents=True, exist_ok=True)
        if is_link(job.tag_dir):
            log.warning(
                "tag %s is a symlink (to %s): replacing the link with a new folder; its target is left untouched",
                job.tag_dir,
                Path(job.tag_dir).resolve(),
            )
        elif job.tag_dir.exists():
            (log.warning if is_complete(job.tag_dir) else log.info)(
                "tag %s exists: replacing it (its done marker is removed first)", job.tag_dir
            )
        tag_folder(job.tag_dir, job.fsync).prepare()
        (job.tag_dir / MODEL_DIR).mkdir()


def _written(tag_dir: Path, paths: list[Path], fsync: bool, sink: Sink) -> list[FileRecord]:
    """Records (size, digests) of files just written; durable with fsync (files and folders); then
    each is handed to `sink`."""
    records = []
    folders = set()
    for path in paths:
        if fsync:
            fsync_path(path)
        folders.add(path.parent)
        records.append(file_record(path, tag_dir))
    if fsync:
        for folder in sorted(folders, key=lambda f: -len(f.parts)):
            fsync_path(folder)
    for path in paths:  # (torch.save wrote them, not a HashingFile): a save to s3:// uploads them now
        sink.closed(path)
    return records


def write_rank_files(job: SaveJob) -> dict[str, Any]:
    """This process's files: its ranks' model files (dp rank 0) and ZeRO-1 optimizer files (its own
    dp shard), and (leader) the plain files."""
    records: list[FileRecord] = []
    master = False
    xser = job.fmt == "xser"
    if job.generic is not None:
        if job.generic.get("model") is not None:
            path = job.tag_dir / MODEL_DIR / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
            records += _written(job.tag_dir, save_object(path, job.generic["model"], False), job.fsync, job.sink)
        if job.generic.get("optimizer") is not None:
            path = job.tag_dir / optim_file(Rank(dp=job.generic["dp"]), Layout())
            records += _written(job.tag_dir, save_object(path, job.generic["optimizer"], False), job.fsync, job.sink)
    for state in job.ranks:
        assert job.layout is not None
        if state.write_model:
            records += write_tensor_file(
                job.tag_dir,
                model_file(state.rank, job.layout, job.fmt),
                state.model,
                job.fmt,
                state.expert,
                job.fsync,
                sink=job.sink,
            )
        if state.optim is not None:
            names = [n for n, _ in state.model]
            obj = build_optim(
                names,
                state.groups,
                state.param_groups,
                state.optim,
                state.dp_size,
                state.rank.dp,
                state.master,
                presharded=state.dp_size > 1,
                shapes=[tuple(t.shape) for _, t in state.model],
            )
            path = job.tag_dir / optim_file(state.rank, job.layout)
            # a tensor at a time through the I/O core's writer (hashed as written, torch.save's bytes)
            records += save_together([path], [obj], xser, bool(state.expert), job.tag_dir, job.fsync, sink=job.sink)
            if job.fsync:
                fsync_path(path.parent)
            master = master or state.master
    if job.leader:
        if job.config is not None:
            records.append(_save_json(job.tag_dir, CONFIG, job.config, job.fsync, job.sink))
        if job.scheduler is not None:
            records.append(save_object_hashed(job.tag_dir, SCHEDULER, job.scheduler, job.fsync, job.sink))
        if job.user_content is not None:
            records.append(save_object_hashed(job.tag_dir, USER_CONTENT, job.user_content, job.fsync, job.sink))
        if job.fsync:
            fsync_path(job.tag_dir)
    first = job.ranks[0].model[0][1].dtype if job.ranks and job.ranks[0].model else None
    groups = next((s.param_groups for s in job.ranks if s.optim is not None), None)
    return {
        "records": records,
        "master": master,
        "param_groups": groups,
        "optimizer": any(s.optim is not None for s in job.ranks)
        or bool(job.generic and job.generic.get("optimizer") is not None),
        "dtype": str(first).replace("torch.", "") if first is not None else None,
    }


def manifest(job: SaveJob, results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """shardkit.json: convert's manifest (formats.manifest) plus a `checkpoint` section."""
    records = [r for res in results for r in res["records"]]
    groups = next((res["param_groups"] for res in results if res["param_groups"] is not None), None)
    section = {
        "tag": job.tag,
        "step": job.step,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": job.world,
        "async": job.async_save,
        "zero1": job.zero1,
        "dp": job.dp_size,
        "generic": job.generic is not None,
        "scheduler": job.scheduler is not None,
        "user_content": job.user_content is not None,
        "optimizer": {
            "format": "nxd-zero1",
            "master_weights": any(res["master"] for res in results),
            "param_groups": jsonable(groups),
        }
        if any(res["optimizer"] for res in results)
        else None,
    }
    if job.generic is not None:
        return build_manifest(
            fmt=job.fmt, family="generic", layout=Layout(), dtype=None, records=records, tensors={}, checkpoint=section
        )
    assert job.layout is not None and job.family is not None and job.dims is not None
    dtype = next((res["dtype"] for res in results if res["dtype"]), None)
    return build_manifest(
        fmt=job.fmt,
        family=job.family.name,
        layout=job.layout,
        dtype=dtype,
        records=records,
        tensors=job.family.full_shapes(job.dims),
        checkpoint=section,
    )


def finish_tag(job: SaveJob, results: Sequence[Mapping[str, Any]]) -> None:
    """Rank 0, after every rank's files are durable: the manifest, then `done`."""
    with translated("write", job.tag_dir):
        write_text(job.tag_dir / MANIFEST, json.dumps(manifest(job, results), indent=2) + "\n", job.fsync)
        tag_folder(job.tag_dir, job.fsync).commit()


def discard_tag(job: SaveJob) -> None:
    """Rank 0, after a failed save: remove the incomplete tag (logged, never raised: the save's own
    failure is the one to report). A tag left by a killed save is removed by the next retention."""
    try:
        tag_folder(job.tag_dir, job.fsync).remove()
    except (OSError, ShardkitError) as e:
        log.warning(
            "could not remove the incomplete checkpoint %s (%s): the next save or prune retries", job.tag_dir, e
        )


def retain(job: SaveJob) -> None:
    """Rank 0, after `done`: retention (the tag just saved is never removed). Failures are logged,
    never raised: what could not be removed is retried at the next save."""
    try:
        plan = plan_retention(
            list_checkpoints(job.root, details=False), job.num_kept, job.keep_every, protect=(job.tag,)
        )
        if plan.remove:
            apply_retention(job.root, plan, job.fsync)
    except Exception:  # noqa: BLE001 - retention must never fail a save or training
        log.exception("checkpoint retention in %s failed (retried at the next save)", job.root)


def run_save(job: SaveJob, comm: Job, retention: Callable[[SaveJob], None] | None = retain) -> None:
    """Steps 2-5 of a save (module docstring), on every rank. A failure on any rank leaves no
    incomplete tag behind (rank 0 removes it); Ctrl-C and SIGTERM of a save in the main thread too."""
    what = f"saving checkpoint {job.tag}"
    with terminate_as_interrupt():
        agree(comm, what, lambda: prepare_tag(job) if job.leader else None, job.tag_dir)
        try:
            results = agree(comm, what, lambda: write_rank_files(job), job.tag_dir)
            agree(comm, what, lambda: finish_tag(job, results) if job.leader else None, job.tag_dir)
        except BaseException:
            if job.leader:
                discard_tag(job)
            raise
    log.info("saved checkpoint %s (%s, %s)", job.tag_dir, job.layout.describe() if job.layout else "generic", job.fmt)
    if job.leader and retention is not None:
        retention(job)


# ---- the Checkpointer -----------------------------------------------------------------------------

_UNSET: Any = object()


class Checkpointer:
    """Saves training checkpoints in NxD's tree, synchronously or in the background.

    One per training process (`save_checkpoint` uses a default one). With torch.distributed
    initialised, create it on every rank at the same point: it creates its gloo group then."""

    def __init__(self, config: CheckpointerConfig | None = None, *, group: Any = _UNSET):
        self.config = config or CheckpointerConfig()
        self.comm = make_job(new_group() if group is _UNSET else group)
        self._writer = BackgroundWriter()
        self._staging = HostStaging(self.config.reuse_buffers)
        self._lock = threading.Lock()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._at_exit())  # type: ignore[union-attr]

    # -- the API
    def save(
        self,
        dir: str | Path,
        tag: str,
        model_state: Mapping[Any, Any],
        optimizer_state: Any = None,
        scheduler: Any = None,
        user_content: Any = None,
        **options: Unpack[SaveOptions],
    ) -> None:
        """Save this rank's state as checkpoint `<dir>/<tag>` in NxD's tree and format.

        With `layout` and `config` (resharding on load possible): `model_state` is this rank's
        pieces {piece name -> tensor} (NxD names, as `family.rank_pieces(layout, dims, tp, pp,
        shapes, ep)` gives them; in a one-process run also {(tp, pp): pieces} for every rank);
        `optimizer_state` {piece name -> {"exp_avg", "exp_avg_sq", "step"[, "master"]}}, an
        OptimizerState, or a torch.optim state_dict with `param_names`; it is written as NxD's
        ZeRO-1 optimizer file. `zero1`: every dp rank passes its own dp shard of each tensor
        (`zero1.dp_shard`) and writes its own `optim/dp_rank_DD_...` file; else dp rank 0 writes one.
        Without `layout` and `config` (like NxD's own save): `model_state` and `optimizer_state` are
        any plain state dicts, saved as they are (model by rank 0; the optimizer by rank 0, or by
        every rank with `zero1`), and `load_checkpoint` gives them back exactly.
        `scheduler`: an LR scheduler (its state_dict is saved) or plain data. `user_content`: plain
        data. `rank`: (tp, pp), (ep, tp, pp) or Rank (default: from torch.distributed).
        `num_kept`/`keep_every`: retention after `done`.

        Returns when the checkpoint is complete (sync), or once the state is copied to host memory
        (async: the write goes on in the background; `wait()` for it). Raises the failure of a
        previous async save before starting."""
        with self._lock:
            self._writer.wait()
            cfg = self.config
            async_save = options.get("async_save")
            saver = run_save
            if (loc := remote_location(dir, "checkpoint directory")) is not None:  # s3://: staged, then uploaded
                from .s3_tags import remote_saver, staging_root

                dir, saver = staging_root(loc), remote_saver(loc, run_save, agree)
            request = SaveRequest(
                Path(dir),
                tag,
                model_state,
                optimizer_state,
                scheduler,
                user_content,
                options,
                fmt=check_format(options.get("format") or cfg.format),
                async_save=cfg.async_save if async_save is None else bool(async_save),
                num_kept=options["num_kept"] if "num_kept" in options else cfg.num_kept,
                keep_every=options["keep_every"] if "keep_every" in options else cfg.keep_every,
            )
            job = self._job(request)
            if loc is not None:  # the staged copy is not the durable one (the uploaded objects are): no fsync
                job.fsync = False
            lock = self._lock_directory(job)
            released = False  # True once the lock's release is handed to the background thread
            try:
                if job.async_save:
                    self._writer.submit_save(job.tag, lambda: _then_release(lambda: saver(job, self.comm), lock))
                    released = True
                else:

                    def purge(j: SaveJob) -> None:
                        nonlocal released
                        self._writer.submit_purge(lambda: _then_release(lambda: retain(j), lock))
                        released = True

                    saver(job, self.comm, retention=purge)
            finally:
                if not released:
                    lock.release()

    def wait(self) -> None:
        """Wait for the save in flight (and its retention); raise its error if it failed."""
        with self._lock:
            self._writer.wait()

    @property
    def in_flight(self) -> bool:
        return self._writer.busy

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread and free the host copies."""
        with self._lock:
            try:
                self._writer.close()
            finally:
                self._staging.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _at_exit(self) -> None:
        try:
            self._writer.close()
        except Exception:
            log.exception("the last checkpoint save failed before exit")
            raise

    def _lock_directory(self, job: SaveJob) -> DirectoryLock:
        """Rank 0 takes the directory's writer lock; every rank learns whether it could (one lock
        per job: the other ranks write into the folder rank 0 locked)."""
        taken: list[DirectoryLock] = []

        def take() -> None:
            if job.leader:
                job.root.mkdir(parents=True, exist_ok=True)
                taken.append(lock_directory(job.root, f"saving checkpoint {job.tag}"))

        try:
            agree(self.comm, f"saving checkpoint {job.tag}", take)
        except BaseException:
            for lock in taken:
                lock.release()
            raise
        return taken[0] if taken else DirectoryLock(job.root, None)

    # -- building a job (caller's thread)
    def _job(self, req: SaveRequest) -> SaveJob:
        layout, config = req.options.get("layout"), req.options.get("config")

        def build() -> SaveJob:
            check_retention(req.num_kept, req.keep_every)
            refuse_link(req.dir)  # never written (nor retention's deletes made) through a link
            tag_path(req.dir, req.tag)  # a plain folder name inside dir, else a one-line error
            if layout is None and config is None:
                return self._generic_job(req)
            if not isinstance(layout, Layout):
                raise CheckpointError("layout= must be a shardkit.Layout (the layout the state is cut in)")
            if config is None:
                raise CheckpointError(
                    "save needs the model's Hugging Face config: pass config= (a dict or config.json)"
                )
            cfg_dict = load_config(config) if isinstance(config, (str, Path)) else dict(config)
            family = family_for(cfg_dict)
            dims = ModelDims.from_config(cfg_dict)
            layout.validate(dims)
            shapes = family.full_shapes(dims)
            dp_size = max(1, self.comm.world // (layout.tp * layout.pp * layout.ep)) if req.zero1 else 1
            states = self._states(family, dims, layout, shapes, req, dp_size)
            job = self._save_job(
                req,
                layout=layout,
                fmt=req.fmt,
                config=cfg_dict,
                family=family,
                dims=dims,
                ranks=states,
                leader=self.comm.rank == 0,
                dp_size=dp_size,
            )
            if req.async_save:
                self._snapshot(job)
            else:
                for s in job.ranks:
                    s.model = [(n, t.cpu()) for n, t in s.model]
                    if s.optim is not None:
                        s.optim = {
                            n: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
                            for n, e in s.optim.items()
                        }
            return job

        built: list[SaveJob] = []

        def claims() -> list[tuple[int, int, int, int]]:
            built.append(build())
            return [(*st.rank.key, st.rank.dp) for st in built[0].ranks if st.write_model]

        answers = agree(self.comm, f"saving checkpoint {req.tag}", claims)
        if layout is not None:
            _check_claims(layout, answers, self.comm.world)
        return built[0]

    def _save_job(self, req: SaveRequest, **fields: Any) -> SaveJob:
        """The SaveJob of `req`: what every save shares (tag, step, plain parts, retention) plus
        `fields` (layout, format, family, ranks, ...)."""
        sched, the_step = _plain_parts(req.tag, req.scheduler, req.user_content, req.options.get("step"))
        return SaveJob(
            root=req.dir,
            tag=str(req.tag),
            step=the_step,
            scheduler=sched,
            user_content=req.user_content,
            num_kept=req.num_kept,
            keep_every=req.keep_every,
            fsync=self.config.fsync,
            async_save=req.async_save,
            world=self.comm.world,
            zero1=req.zero1,
            **fields,
        )

    def _generic_job(self, req: SaveRequest) -> SaveJob:
        """A checkpoint of any state dicts, without a model family (like NxD's own save)."""
        if req.fmt != "torch":
            raise CheckpointError(
                f"a checkpoint without layout= and config= is saved as torch files, not {req.fmt}: "
                "pass layout= and config= for other formats"
            )
        leader = self.comm.rank == 0
        check_plain(req.model_state, "model_state")
        optimizer_state = req.optimizer_state
        if optimizer_state is not None:
            if isinstance(optimizer_state, torch.optim.Optimizer):
                optimizer_state = optimizer_state.state_dict()
            check_plain(optimizer_state, "optimizer_state")
        writes_optim = optimizer_state is not None and (req.zero1 or leader)
        generic = {
            "model": req.model_state if leader else None,
            "optimizer": optimizer_state if writes_optim else None,
            "dp": self.comm.rank if req.zero1 else 0,
        }
        job = self._save_job(
            req,
            layout=None,
            fmt="torch",
            config=None,
            family=None,
            dims=None,
            ranks=[],
            leader=leader,
            dp_size=self.comm.world if req.zero1 else 1,
            generic=generic,
        )
        if req.async_save:
            generic["model"] = host_copy(generic["model"])
            generic["optimizer"] = host_copy(generic["optimizer"])
            job.scheduler = host_copy(job.scheduler)
            job.user_content = host_copy(job.user_content)
        return job

    def _states(self, family, dims, layout, shapes, req: SaveRequest, dp_size: int = 1) -> list[RankState]:
        model_state, optimizer_state, param_names = req.model_state, req.optimizer_state, req.options.get("param_names")
        if not isinstance(model_state, Mapping):
            raise CheckpointError(f"model_state must be a dict of this rank's pieces, got {type(model_state).__name__}")
        if is_rank_mapping(model_state):
            if self.comm.world > 1:
                raise CheckpointError(
                    "in a torch.distributed job each process saves its own rank: pass "
                    "{piece name -> tensor}, not {rank -> pieces}"
                )
            ranks = {Rank.of(k, layout): k for k in model_state}
            opts = optimizer_state or {}
            names = param_names or {}
            return [
                rank_state(
                    family,
                    dims,
                    layout,
                    r,
                    shapes,
                    model_state[k],
                    normalize_optimizer(opts.get(k), names.get(k) if isinstance(names, Mapping) else None),
                )
                for r, k in sorted(ranks.items(), key=lambda rk: rk[0].key)
            ]
        me = Rank.of(req.options.get("rank"), layout)
        if me.dp > 0 and dp_size == 1:
            return []  # a data-parallel replica holds dp 0's state and writes nothing (see base.py)
        if isinstance(param_names, Mapping):
            raise CheckpointError("param_names must be a list of this rank's piece names")
        return [
            rank_state(
                family,
                dims,
                layout,
                me,
                shapes,
                model_state,
                normalize_optimizer(optimizer_state, param_names),
                dp_size,
            )
        ]

    def _snapshot(self, job: SaveJob) -> None:
        """Copy every tensor to host memory (reused buffers), so training may change its own."""
        staging = self._staging
        staging.begin()
        try:
            with one_torch_thread():  # plain copies
                for s in job.ranks:
                    s.model = [(n, staging.copy((s.rank.key, n), t)) for n, t in s.model]
                    if s.optim is not None:
                        s.optim = {
                            n: {
                                k: staging.copy((s.rank.key, k, n), v) if isinstance(v, torch.Tensor) else v
                                for k, v in e.items()
                            }
                            for n, e in s.optim.items()
                        }
        finally:
            staging.end()
        job.scheduler = host_copy(job.scheduler)
        job.user_content = host_copy(job.user_content)


def _then_release(task: Callable[[], Any], lock: DirectoryLock) -> Any:
    try:
        return task()
    finally:
        lock.release()


def _plain_parts(tag: str, scheduler: Any, user_content: Any, step: int | None) -> tuple[Any, int | None]:
    """The scheduler's state and the step of a save (given, else from the tag name, else
    user_content["step"]); user_content must be plain data."""
    if user_content is not None:
        check_plain(user_content, "user_content")
    the_step = step if step is not None else tag_step(str(tag))
    if the_step is None and isinstance(user_content, Mapping) and isinstance(user_content.get("step"), int):
        the_step = user_content["step"]
    return scheduler_state(scheduler), the_step


def _check_claims(layout: Layout, claims: Sequence[Sequence[tuple[int, int, int, int]]], world: int) -> None:
    """Every (ep, tp, pp) rank of the layout must be saved by exactly one process (dp 0)."""
    seen: dict[tuple[int, int, int], int] = {}
    for proc, mine in enumerate(claims):
        for ep, tp, pp, dp in mine:
            if dp != 0:
                continue
            if (ep, tp, pp) in seen:
                raise CheckpointError(
                    f"processes {seen[(ep, tp, pp)]} and {proc} both save rank "
                    f"(tp {tp}, pp {pp}{f', ep {ep}' if ep else ''}): give each process its own rank"
                )
            seen[(ep, tp, pp)] = proc
    missing = [k for k in layout.ranks() if k not in seen]
    if missing:
        ep, tp, pp = missing[0]
        n = layout.tp * layout.pp * layout.ep
        hint = (
            (
                "run one process per rank with torch.distributed (world size a multiple of "
                f"{n}), or pass every rank's pieces as model_state={{(tp, pp): pieces}}"
            )
            if world == 1
            else f"the job has {world} processes: the world size must be a multiple of tp x pp x ep = {n}"
        )
        raise LayoutError(
            f"no process saves rank (tp {tp}, pp {pp}{f', ep {ep}' if ep else ''}) of "
            f"{layout.describe()} ({len(missing)} of {n} ranks missing): {hint}"
        )


# ---- the function API ----------------------------------------------------------------------------

_default: Checkpointer | None = None
_default_lock = threading.Lock()


def default_checkpointer() -> Checkpointer:
    """The process's Checkpointer behind `save_checkpoint` (created at the first save, on every rank)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Checkpointer()
        return _default


def save_checkpoint(
    dir: str | Path,
    tag: str,
    model_state: Any,
    optimizer_state: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    **options: Unpack[SaveOptions],
) -> None:
    """Save checkpoint `<dir>/<tag>` with the process's default Checkpointer: the arguments and
    keyword options (SaveOptions) of `Checkpointer.save`."""
    default_checkpointer().save(dir, tag, model_state, optimizer_state, scheduler, user_content, **options)


def finalize_checkpoint() -> None:
    """Wait for the default Checkpointer's save in flight; raise its error (call before exit or
    before destroying the process group)."""
    if _default is not None:
        _default.wait()


__all__ = ["Checkpointer", "save_checkpoint", "finalize_checkpoint", "default_checkpointer"]
