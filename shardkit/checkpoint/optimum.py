"""optimum-neuron's training checkpoints as a `ckpt` source: model, optimizer state, scheduler.

optimum-neuron's NeuronTrainer saves each checkpoint as `<output_dir>/checkpoint-<step>/`
(transformers' folder name): the model folder `formats/optimum_neuron.py` reads (config.json,
`shards/` with NxD's markers, rank files and mp_metadata), plus, from the trainer, `scheduler.pt`
(the scheduler's state_dict), `trainer_state.json`, `training_args.bin` (a pickled Python object,
never read here) and the tokenizer files. Its optimizer state is what NxD's `save_checkpoint`
writes when handed the trainer's optimizer (docs/FORMATS.md, "optimum-neuron's optimizer
state"): `shards/optim/dp_rank_00_tp_rank_TT_pp_rank_PP.pt`, one per (tp, pp) rank, holding

- with `zero_1` (optimum-neuron 0.4's default): NxD's ZeRO-1 state dict, exactly the file of
  NxD's own ZeRO-1 layout at dp 1, which `Zero1Tag` reads as it is; with more than one
  data-parallel rank it holds one rank's shard only (the others were never written) and is refused;
- without: torch's optimizer `state_dict()` (`state` by index, `param_groups`), read here as the
  same ZeRO-1 state at dp 1 (`_as_zero1`).

The parameter groups are the trainer's (decay, then no decay for biases and norms), the index
order the stage's `named_parameters()` order within each group: NxD's own grouping for Llama, so
`Zero1Tag`'s index recovery applies unchanged. A `checkpoint-<step>` folder (or its `shards/`) is
a tag; the output directory holding them is a checkpoint directory whose newest complete one
(`shards/done`) is read unless `--tag checkpoint-<step>` says which.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..formats import Checkpoint, open_checkpoint, optimum_neuron
from ..io.safety.small import SmallFileError, read_json
from ..io.store import Store
from .base import IncompleteCheckpointError, NoCheckpointError
from .tree import DONE_MARKER, OPTIM_DIR, USER_CONTENT, tag_path, tag_step
from .zero1 import MOMENTS, MergedOptimFile, OptimFileError, Zero1Tag, is_xser_tag, load_object

PREFIX = "checkpoint-"
"""transformers' PREFIX_CHECKPOINT_DIR: the trainer's checkpoint folders are checkpoint-<step>."""
TRAINER_STATE = "trainer_state.json"


def folder_of(path: str | Path) -> Path | None:
    """The optimum-neuron checkpoint folder `path` is (the saved folder or its shards/), else None."""
    shards = optimum_neuron.shards_of(Path(path))
    return shards.parent if shards is not None else None


def is_optimum_tag(path: str | Path) -> bool:
    return folder_of(path) is not None


def find_tag(directory: str | Path, tag: str | None) -> tuple[Path, str] | None:
    """(directory, tag) for an optimum-neuron checkpoint: `directory` itself (a checkpoint-<step>
    folder or its shards/), or the trainer's output directory holding checkpoint-<step> folders
    (`tag`, or the newest whose shards/ are complete). None when it is none of these."""
    directory = Path(directory)
    folder = folder_of(directory) if tag is None else tag_path(directory, tag)  # a plain name inside it
    if folder is not None and folder_of(folder) == folder:
        if not (folder / optimum_neuron.SHARDS / DONE_MARKER).is_file():
            raise IncompleteCheckpointError(
                f"{folder} is an optimum-neuron checkpoint whose save did not finish (no {optimum_neuron.SHARDS}/"
                f"{DONE_MARKER}): use another checkpoint-<step>"
            )
        return folder.parent, folder.name
    if tag is not None or not directory.is_dir():
        return None
    runs = [p for p in directory.iterdir() if p.name.startswith(PREFIX) and p.is_dir() and folder_of(p) == p]
    if not runs:
        return None
    complete = [p for p in runs if (p / optimum_neuron.SHARDS / DONE_MARKER).is_file()]
    if not complete:
        raise NoCheckpointError(
            f"{directory} holds optimum-neuron checkpoints ({', '.join(sorted(p.name for p in runs))}) but none is "
            "complete (no shards/done): their save was interrupted"
        )
    newest = max(complete, key=lambda p: (tag_step(p.name) or -1, p.name))
    return directory, newest.name


def native_format(tag_dir: Path, model_format: str) -> str:
    """The format a tag's files are in, as NxD names it: an optimum-neuron checkpoint's is xser (its
    default use_xser) or torch; any other tag's, its model's."""
    if not is_optimum_tag(tag_dir):
        return model_format
    shards = optimum_neuron.shards_of(tag_dir)
    return "xser" if shards is not None and is_xser_tag(shards) else "torch"


def open_model(tag_dir: Path, config: Any = None, store: Store | None = None) -> Checkpoint:
    """The checkpoint's model (its config.json, or `config`; read through `store`)."""
    return open_checkpoint(tag_dir, config, store=store)


def open_parts(
    tag_dir: Path, config: Any = None, param_order: list[list[str]] | None = None, store: Store | None = None
) -> tuple[Checkpoint, Zero1Tag | None, dict[str, Any]]:
    """(model, optimizer state, plain values to write) of the checkpoint folder `tag_dir` (read
    through `store`): the trainer's state (trainer_state.json) becomes the new tag's user content."""
    model = open_model(tag_dir, config, store)
    shards = optimum_neuron.shards_of(tag_dir)
    assert shards is not None
    zero = OptimumOptimizer.open(shards, model, param_order)
    plain: dict[str, Any] = {}
    state_file = Path(tag_dir) / TRAINER_STATE
    if os.path.lexists(state_file):  # read within the folder: a link out of it (or a dangling one) is refused
        try:
            plain[USER_CONTENT] = read_json(state_file, "optimum-neuron's trainer_state.json", within=tag_dir)
        except SmallFileError as e:
            raise OptimFileError(str(e)) from None
    return model, zero, plain


class OptimumOptimizer(Zero1Tag):
    """optimum-neuron's `shards/optim/` files as NxD's ZeRO-1 state at dp 1 (see the module)."""

    def _rel(self, path: Path) -> str:  # checkpoint-<step>/shards/optim/...
        return f"{self.tag_dir.parent.name}/{super()._rel(path)}"

    def object(self, d: int, ep: int, tp: int, pp: int) -> dict[str, Any]:
        key = (d, ep, tp, pp)
        if key not in self._objects:
            obj = load_object(self.files[key], self.use_xser, self.model.store)
            self._objects[key] = _as_zero1(obj, self._rel(self.files[key]))
        return self._objects[key]

    def merged_reader(self, ep: int, tp: int, pp: int) -> MergedOptimFile:
        return _MergedFile(self, ep, tp, pp)

    def _check(self) -> None:
        if self.dp != 1:
            raise OptimFileError(
                f"{self.tag_dir}/{OPTIM_DIR} holds files of dp ranks other than 00: optimum-neuron's trainer writes "
                "dp rank 00 only, so this is not its checkpoint"
            )
        for ep, tp, pp in self.model.layout.ranks():
            _check_whole(self.object(0, ep, tp, pp), self._rel(self.files[(0, ep, tp, pp)]))
        super()._check()


class _MergedFile(MergedOptimFile):
    """A rank's optimizer state as `MergedOptimFile` reads it, from either kind of file."""

    tag: OptimumOptimizer

    def _objects(self) -> list[Any]:
        if self._objs is None:
            path = self.tag.files[(0, self.ep, self.tp, self.pp)]
            self._objs = [_as_zero1(load_object(path, self.tag.use_xser), self.tag._rel(path))]
        return self._objs


def _as_zero1(obj: Any, where: str) -> dict[str, Any]:
    """A saved optimizer state as NxD's ZeRO-1 state dict: as it is, or torch's optimizer
    state_dict (`state` by index) with `base_state` = its state and `shape_info` its moments' shapes."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("param_groups"), list):
        raise OptimFileError(
            f"{where} is not an optimizer state dict (no param_groups): not optimum-neuron's trainer's"
        )
    if isinstance(obj.get("base_state"), Mapping):
        return dict(obj)
    state = obj.get("state")
    if not isinstance(state, Mapping):
        raise OptimFileError(f"{where} holds neither ZeRO-1's base_state nor torch's optimizer state")
    shapes: dict[int, list[int]] = {}
    for idx, entry in state.items():
        moment = entry.get("exp_avg") if isinstance(entry, Mapping) else None
        if not isinstance(moment, torch.Tensor):
            raise OptimFileError(f"{where}: state[{idx}] has no exp_avg: only Adam-style optimizer state is supported")
        shapes[idx] = list(moment.shape)
    return {"state": {}, "param_groups": obj["param_groups"], "base_state": dict(state), "shape_info": shapes}


def _check_whole(obj: Mapping[str, Any], where: str) -> None:
    """Refuse a ZeRO-1 file that holds one data-parallel rank's shard of a dp > 1 run: optimum-neuron's
    trainer saves such a run's optimizer through NxD's unsharded path, from dp rank 0 only."""
    for idx, shape in obj["shape_info"].items():
        entry = obj["base_state"].get(idx)
        moment = entry.get(MOMENTS[0]) if isinstance(entry, Mapping) else None
        if isinstance(moment, torch.Tensor) and shape and moment.dim() and moment.shape[0] < int(shape[0]):
            raise OptimFileError(
                f"{where} holds {moment.shape[0]} of the {int(shape[0])} rows of optimizer index {idx}'s moments: optimum-neuron "
                "saved a ZeRO-1 run with several data-parallel ranks, and NxD's save_checkpoint kept one rank's shard "
                "only, so the optimizer state is incomplete; the weights are whole (`shardkit ckpt export`)"
            )
