"""optimum-neuron's training checkpoints (Hugging Face's trainer for Trainium), read and written.

optimum-neuron's `save_pretrained` saves a model through NxD's `save_checkpoint` under the tag
`shards` and adds what its consolidation needs to give the Hugging Face weights back:

    <dir>/config.json, trn_config.json            the model's config, optimum-neuron's parallel config
    <dir>/shards/checkpoint, done                  NxD's markers
    <dir>/shards/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt    one state dict per (tp, pp) rank
    <dir>/shards/mp_metadata_pp_rank_P.json        per stage: every parameter's NxD tensor-parallel
                                                   attributes and each custom module's transformation specs

The rank files are NxD rank files (torch, or xser with optimum-neuron's default `use_xser`) whose
names and cuts are ones shardkit's layouts already write for Llama: gate and up fused per rank
(`FusedLinearsSpec` gate_up_proj), q/k/v separate, coalesced (`FusedLinearsSpec` qkv_proj, when
the model has as many kv heads as heads and `fuse_qkv`) or in NxD's GQA layer (`weight_q/_k/_v`
or `weight_qkv`, `GQAQKVColumnParallelLinearSpec`, used when tp exceeds the kv heads or does not
divide them), whose kv heads are replicated `repeat`-wise (shardkit's interleaved order) and
whose q heads (and o_proj's columns) follow those replicas. So a checkpoint is read as the layout
its metadata describes, and that metadata must be exactly what this module would write for the
layout (`stage_metadata`), or the checkpoint is refused: nothing is guessed. Writing is the
engine's NxD rank files under `shards/model/` (`plan_outputs`) and, once they are written, the
metadata, trn_config.json and the markers (`finish_folder`).

Llama only, as optimum-neuron's own Llama model has it (no biases, untied embeddings, one
pipeline chunk per stage, no expert parallelism); what else optimum-neuron saves (its optimizer
under `shards/optim/`, LoRA adapters under `adapter_*/adapter_shards/`) is not read here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FormatError, LayoutError
from ..io.data.digest import FileRecord
from ..io.safety.durable import write_marker, write_text
from ..io.safety.small import read_json
from ..layout import Layout, ModelDims
from ..placements import Piece

if TYPE_CHECKING:
    from ..families import Family

SHARDS = "shards"
"""The tag optimum-neuron saves under (its MODEL_PARALLEL_SHARDS_DIR_NAME)."""
TRN_CONFIG = "trn_config.json"
FAMILIES = ("llama",)


def metadata_name(pp_rank: int) -> str:
    return f"mp_metadata_pp_rank_{pp_rank}.json"


def rank_key(tp: int, pp: int) -> str:
    """A rank file's path in the checkpoint folder (NxD's v2 name; dp index always 00)."""
    return f"{SHARDS}/model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def shards_of(root: Path) -> Path | None:
    """The `shards` folder of an optimum-neuron checkpoint `root` (the saved folder, or `shards`
    itself); None when `root` is not one."""
    root = Path(root)
    for shards in (root / SHARDS, root):
        if (shards / metadata_name(0)).is_file() and (shards / "model").is_dir():
            return shards
    return None


# ---- what optimum-neuron's Llama is for a layout ------------------------------------------------


def check_layout(family: Family, dims: ModelDims, layout: Layout) -> None:
    """One line when optimum-neuron's Llama cannot be `layout`: it chooses its qkv layer from tp
    and the head counts, and takes no expert or virtual pipeline parallelism here."""
    if family.name not in FAMILIES:
        raise LayoutError(f"--format optimum-neuron writes Llama models only, not {family.name}")
    if dims.attention_bias or dims.mlp_bias or dims.tie_word_embeddings:
        raise LayoutError("--format optimum-neuron writes Llama without biases and with untied embeddings only")
    if layout.ep > 1 or layout.vpp > 1:
        raise LayoutError("--format optimum-neuron takes no --ep or --vpp")
    layout.validate(dims)
    if dims.vocab_size % layout.tp:
        raise LayoutError(f"vocab size {dims.vocab_size} is not divisible by tp {layout.tp} (optimum-neuron pads none)")
    heads, kv, tp = dims.num_heads, dims.num_kv_heads, layout.tp
    if kv < tp or kv % tp:
        if layout.qkv not in ("gqa", "fused") or (layout.kv_multiplier > 1 and layout.kv_replication != "interleaved"):
            raise LayoutError(
                f"optimum-neuron uses NxD's GQA qkv layer when tp {tp} exceeds or does not divide the {kv} kv heads: "
                "use --qkv gqa (or fused, its fuse_qkv) with --kv-replication interleaved"
            )
    elif layout.kv_multiplier > 1 or layout.qkv not in (("separate", "coalesced") if heads == kv else ("separate",)):
        fused = " (or coalesced, its fuse_qkv)" if heads == kv else ""
        raise LayoutError(
            f"optimum-neuron keeps q/k/v separate when tp {tp} divides the {kv} kv heads: "
            f"use --qkv separate{fused} and --kv-multiplier 1"
        )


def _gqa_spec(dims: ModelDims, layout: Layout) -> list[Any]:
    fields = {
        "gqa_qkv_projection_name": "qkv_proj",
        "query_projection_name": "q_proj",
        "key_projection_name": "k_proj",
        "value_projection_name": "v_proj",
        "output_projection_name": "o_proj",
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "kv_size_multiplier": layout.kv_multiplier,
        "q_output_size_per_partition": dims.num_heads * dims.head_dim // layout.tp,
        "kv_output_size_per_partition": dims.num_kv_heads * layout.kv_multiplier * dims.head_dim // layout.tp,
        "fuse_qkv": layout.qkv == "fused",
        "bias": False,
        "tp_size": layout.tp,
        "peft_type": None,
    }
    return ["GQAQKVColumnParallelLinearSpec", fields]


def _fused_spec(fused: str, linears: list[str], rows: int, tp: int) -> list[Any]:
    fields = {
        "fused_linear_name": fused,
        "linear_names": linears,
        "bias": False,
        "fuse_axis": 0,  # "column", as the spec stores it
        "original_dims": [rows] * len(linears),
        "tp_size": tp,
        "peft_type": None,
    }
    return ["FusedLinearsSpec", fields]


def _parallel(dim: int, stride: int, tp: int) -> dict[str, Any]:
    return {"tensor_model_parallel": True, "partition_dim": dim, "partition_stride": stride, "num_partitions": tp}


def _layer(dims: ModelDims, layout: Layout, i: int) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]]]:
    """Decoder layer i's parameters (named_parameters order, NxD attributes) and its two custom
    modules' specs (self_attn, mlp), as optimum-neuron's LlamaDecoderLayer builds them."""
    tp, attn, mlp = layout.tp, f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    params: dict[str, dict[str, Any]] = {}
    attn_specs: list[Any] = []
    if layout.qkv in ("gqa", "fused"):
        names = ["weight_qkv"] if layout.qkv == "fused" else ["weight_q", "weight_k", "weight_v"]
        params.update({f"{attn}.qkv_proj.{n}": _parallel(0, 1, tp) for n in names})
        attn_specs.append(_gqa_spec(dims, layout))
    elif layout.qkv == "coalesced":
        params[f"{attn}.qkv_proj.weight"] = _parallel(0, 3, tp)
        attn_specs.append(_fused_spec("qkv_proj", ["q_proj", "k_proj", "v_proj"], dims.num_heads * dims.head_dim, tp))
    else:
        params.update({f"{attn}.{p}.weight": _parallel(0, 1, tp) for p in ("q_proj", "k_proj", "v_proj")})
    params[f"{attn}.o_proj.weight"] = _parallel(1, 1, tp)
    params[f"{mlp}.gate_up_proj.weight"] = _parallel(0, 2, tp)
    params[f"{mlp}.down_proj.weight"] = _parallel(1, 1, tp)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        params[f"model.layers.{i}.{norm}.weight"] = {"tensor_model_parallel": False}
    mlp_spec = _fused_spec("gate_up_proj", ["gate_proj", "up_proj"], dims.intermediate_size, tp)
    return params, {attn: attn_specs, mlp: [mlp_spec]}


def stage_metadata(dims: ModelDims, layout: Layout, pp_rank: int) -> dict[str, Any]:
    """mp_metadata_pp_rank_<pp_rank>.json as optimum-neuron's `create_parameter_metadata` writes
    it: the stage's parameters with their attributes, and every custom module of the model with
    the specs that touch the stage's parameters (none for the other stages' modules)."""
    tp, stages = layout.tp, layout.stage_layers(dims.num_layers)
    params: dict[str, dict[str, Any]] = {}
    if pp_rank == 0:
        params["model.embed_tokens.weight"] = _parallel(0, 1, tp)
    specs = []
    for i in range(dims.num_layers):
        layer_params, modules = _layer(dims, layout, i)
        mine = i in stages[pp_rank]
        if mine:
            params.update(layer_params)
        for module, module_specs in modules.items():
            specs.append({"module_fully_qualified_name": module, "specs": module_specs if mine else []})
    if pp_rank == layout.pp - 1:
        params["model.norm.weight"] = {"tensor_model_parallel": False}
        params["lm_head.weight"] = _parallel(0, 1, tp)
    return {"parameters": params, "model_weight_transformation_specs": specs}


def trn_config(layout: Layout) -> dict[str, Any]:
    """The parallel settings of optimum-neuron's TrainingNeuronConfig this checkpoint was cut for."""
    gqa = layout.qkv in ("gqa", "fused")
    return {
        "tensor_parallel_size": layout.tp,
        "kv_size_multiplier": layout.kv_multiplier if gqa else None,
        "pipeline_parallel_size": layout.pp,
        "use_xser": False,
        "fuse_qkv": layout.qkv in ("fused", "coalesced"),
    }


# ---- writing -----------------------------------------------------------------------------------


def plan_outputs(
    family: Family, dims: ModelDims, layout: Layout, convention: str | None = None
) -> list[tuple[str, list[Piece], tuple[int, int, int]]]:
    """The rank files of `layout` under shards/model/, each with its pieces (NxD's names, which
    optimum-neuron's Llama uses)."""
    if convention not in (None, "hf"):
        raise LayoutError(f"--convention {convention} names tensors in --format dcp only; optimum-neuron keeps NxD's")
    check_layout(family, dims, layout)
    shapes = family.full_shapes(dims)
    return [
        (rank_key(tp, pp), family.rank_pieces(layout, dims, tp, pp, shapes), (0, tp, pp))
        for _, tp, pp in layout.ranks()
    ]


def finish_folder(
    folder: Path, records: Sequence[FileRecord], family: Family, dims: ModelDims, layout: Layout
) -> list[Path]:
    """What optimum-neuron writes beside the rank files: each stage's metadata, trn_config.json,
    and NxD's `checkpoint` and (last) `done` markers. Returns the files written."""
    shards = Path(folder) / SHARDS
    written = []
    for pp in range(layout.pp):
        path = shards / metadata_name(pp)
        write_text(path, json.dumps(stage_metadata(dims, layout, pp), indent=4), fsync=False)
        written.append(path)
    write_text(Path(folder) / TRN_CONFIG, json.dumps(trn_config(layout), indent=4) + "\n", fsync=False)
    write_marker(shards, "checkpoint", fsync=False)
    write_marker(shards, "done", fsync=False)
    return [*written, Path(folder) / TRN_CONFIG, shards / "checkpoint", shards / "done"]


# ---- reading -----------------------------------------------------------------------------------


@dataclass
class Described:
    """An optimum-neuron checkpoint as the layout its metadata says, and its rank files."""

    shards: Path
    layout: Layout
    keys_by_rank: dict[tuple[int, int, int], str]
    """(ep, tp, pp) -> the rank file's path relative to the checkpoint folder."""


def _stage_count(shards: Path) -> int:
    pp = 0
    while (shards / metadata_name(pp)).is_file():
        pp += 1
    return pp


def _layout_of(metadata: dict[str, Any], dims: ModelDims, tp: int, pp: int, where: Path) -> Layout:
    """The layout a stage's metadata describes: the qkv layer from its specs (NxD's GQA layer with
    its kv multiplier, a fused qkv_proj, or none)."""
    try:
        specs = [s for module in metadata["model_weight_transformation_specs"] for s in module["specs"]]
        qkv, multiplier = "separate", 1
        for name, fields in specs:
            if name == "GQAQKVColumnParallelLinearSpec":
                qkv, multiplier = ("fused" if fields["fuse_qkv"] else "gqa"), int(fields["kv_size_multiplier"])
            elif name == "FusedLinearsSpec" and fields["fused_linear_name"] == "qkv_proj":
                qkv = "coalesced"
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{where} is not optimum-neuron's metadata (no readable transformation specs)") from None
    return Layout(tp=tp, pp=pp, qkv=qkv, kv_multiplier=multiplier, kv_replication="interleaved")


def describe(root: Path, family: Family, dims: ModelDims) -> Described:
    """The layout of the optimum-neuron checkpoint `root` (see `shards_of`), from its metadata and
    rank files, refused in one line unless every stage's metadata is what this layout writes."""
    shards = shards_of(root)
    if shards is None:
        raise FormatError(f"{root} is not an optimum-neuron checkpoint (no {SHARDS}/{metadata_name(0)})")
    base = Path(root) if shards != Path(root) else shards.parent
    pp = _stage_count(shards)
    names = sorted(p.name for p in (shards / "model").glob("dp_rank_00_tp_rank_*_pp_rank_00.pt"))
    tp = len(names)
    if tp == 0:
        raise FormatError(f"{shards / 'model'} holds no rank files (dp_rank_00_tp_rank_00_pp_rank_00.pt)")
    metadata = [read_json(shards / metadata_name(p), "optimum-neuron metadata", within=base) for p in range(pp)]
    layout = _layout_of(metadata[0], dims, tp, pp, shards / metadata_name(0))
    try:
        check_layout(family, dims, layout)
    except LayoutError as e:
        raise FormatError(f"{shards}: not an optimum-neuron checkpoint shardkit reads ({e})") from None
    keys: dict[tuple[int, int, int], str] = {}
    for p in range(pp):
        want = stage_metadata(dims, layout, p)
        if metadata[p] != want:
            raise FormatError(
                f"{shards / metadata_name(p)} is not what optimum-neuron writes for {layout.describe()} "
                f"of this config ({_first_difference(metadata[p], want)}): the config or the checkpoint differs"
            )
        for t in range(tp):
            key = rank_key(t, p)
            if not (base / key).is_file():
                raise FormatError(f"rank file {key} is missing from {base}: copy it back or re-create the checkpoint")
            keys[(0, t, p)] = key
    return Described(shards, layout, keys)


def _first_difference(have: dict[str, Any], want: dict[str, Any]) -> str:
    hp, wp = have.get("parameters", {}), want["parameters"]
    for name in [*wp, *hp]:
        if hp.get(name) != wp.get(name):
            return f"parameter {name}: {hp.get(name)} where {wp.get(name)} was expected"
    return "its transformation specs differ"


def is_rank_file(path: Path) -> bool:
    """A rank file of an optimum-neuron checkpoint (under shards/model/, metadata beside)."""
    return path.parent.name == "model" and (path.parent.parent / metadata_name(0)).is_file()
