"""optimum-neuron's own checkpoint code, run outside shardkit (no shardkit import here).

optimum-neuron (Hugging Face's trainer for Trainium) needs neuronx-distributed and torch-xla, and
pins a transformers release older than the one shardkit's tests use, so it is not installed. Its
two modules that define the checkpoint's meaning are pure torch once NxD's few helpers are given:

- `optimum/neuron/models/training/transformations_utils.py`: the weight-transformation specs
  (fused linears, the GQA qkv layer with its kv replication and q permutation), how they shard
  original weights for a tp rank (`adapt_state_dict`), their metadata, and how they give the
  original weights back (`to_original_weights`);
- `optimum/neuron/models/training/checkpointing.py`: the consolidation of a saved checkpoint
  (`consolidate_model_parallel_checkpoints_to_unified_checkpoint`).

They are taken from the folder OPTIMUM_NEURON_SRC names, which the `fetch` command below fills from
the published optimum-neuron wheel (`OPTIMUM_NEURON_VERSION`, `pip download --no-deps`; .ci/run
does it before the tests, which never touch the network) and executed as they are, with stand-ins only for what lives outside them:
NxD's tp rank and size and its `create_local_weight` (split a full weight into chunks of
per_partition_size / stride along the partition dim and keep chunks rank, rank + tp, ...), optimum's
logger and PEFT probe, and the two folder-name constants of modules that import NxD (read from those
modules' source text).

Commands (each in its own process; exit 0 on success, 77 when OPTIMUM_NEURON_SRC is not there):

    python tests/support/optimum_neuron_ref.py fetch DIR
        optimum-neuron's modules from its wheel on PyPI into DIR (then OPTIMUM_NEURON_SRC=DIR)

    python tests/support/optimum_neuron_ref.py consolidate SAVE_DIR OUT_DIR
        optimum-neuron's consolidation of SAVE_DIR (which holds shards/) into OUT_DIR (safetensors)
    python tests/support/optimum_neuron_ref.py save HF_DIR SAVE_DIR TP PP FUSE_QKV KV_MULTIPLIER
        HF_DIR's Llama weights sharded by optimum-neuron's own specs and helpers for every tp rank,
        saved as optimum-neuron's save_pretrained lays them out (shards/model/dp_rank_00_tp_rank_TT_
        pp_rank_PP.pt, torch.save as NxD's save_checkpoint without xser, mp_metadata_pp_rank_P.json
        from its specs' own to_metadata, config.json); KV_MULTIPLIER 0 = optimum's automatic choice
    python tests/support/optimum_neuron_ref.py save HF_DIR SAVE_DIR TP PP FUSE_QKV KV_MULTIPLIER OPTIM GRADS
        the same, as a training checkpoint of optimum-neuron's NeuronTrainer (SAVE_DIR = its
        checkpoint-<step>): with the optimizer state NxD's save_checkpoint writes for it under
        shards/optim/, the trainer's scheduler.pt and trainer_state.json (see `_optimizer_files`).
        OPTIM: adamw (zero_1 off), zero1 (zero_1 on, dp 1) or zero1-dp2 (zero_1 on, dp 2: what is
        saved of it); a "+xser" suffix writes the model and optimizer files in torch-xla's format,
        optimum-neuron's default use_xser (`_xser_save`). The moments come from torch's own AdamW, two steps over gradients that are
        shards (made by optimum-neuron's own adapt_state_dict) of seeded full-model gradients,
        written to the file GRADS (safetensors, `step<k>.<Hugging Face name>`) for the tests.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import types
from pathlib import Path

import torch

OPTIMUM_NEURON_VERSION = "0.4.5"
UNAVAILABLE = 77  # exit status when optimum-neuron's source cannot be had
TRAINING = "optimum/neuron/models/training"
FILES = (
    f"{TRAINING}/transformations_utils.py",
    f"{TRAINING}/checkpointing.py",
    f"{TRAINING}/modeling_utils.py",
    "optimum/neuron/peft/peft_model.py",
)


def source_dir() -> Path:
    """The folder holding optimum-neuron's modules (FILES): OPTIMUM_NEURON_SRC, as `fetch` fills it
    (.ci/run does). Tests never fetch it themselves: without it they skip, saying how to get it."""
    given = os.environ.get("OPTIMUM_NEURON_SRC")
    folder = Path(given) if given else None
    if folder is None or not all((folder / f).is_file() for f in FILES):
        print(
            f"optimum-neuron {OPTIMUM_NEURON_VERSION}'s source is not here: run `python tests/support/optimum_neuron_ref.py "
            "fetch DIR` (needs PyPI) and set OPTIMUM_NEURON_SRC=DIR",
            file=sys.stderr,
        )
        raise SystemExit(UNAVAILABLE)
    return folder


def fetch(folder: Path) -> None:
    """optimum-neuron's modules (FILES) from its published wheel (`pip download --no-deps`) into `folder`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from wheel_files import fetch_wheel_files

    fetch_wheel_files(f"optimum-neuron=={OPTIMUM_NEURON_VERSION}", FILES, folder)


class _NxD:
    """NxD's parallel state as the specs read it: this process plays one tp rank at a time."""

    rank = 0
    size = 1

    @staticmethod
    def create_local_weight(full_weight, partition_dim, per_partition_size, stride, out_weight=None):
        chunks = torch.split(full_weight, per_partition_size // stride, dim=partition_dim)
        return torch.cat(chunks[_NxD.rank :: _NxD.size], dim=partition_dim, out=out_weight)


def _package(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _constant(path: Path, name: str) -> str:
    match = re.search(rf'^{name} = "([^"]+)"', path.read_text(), re.M)
    assert match, f"{name} not found in {path}"
    return match.group(1)


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """(transformations_utils, checkpointing), optimum-neuron's own modules, importable here."""
    src = source_dir()
    _package("neuronx_distributed")
    _package("neuronx_distributed.parallel_layers")
    _package("neuronx_distributed.parallel_layers.layers", create_local_weight=_NxD.create_local_weight)
    _package(
        "neuronx_distributed.parallel_layers.parallel_state",
        get_tensor_model_parallel_rank=lambda: _NxD.rank,
        get_tensor_model_parallel_size=lambda: _NxD.size,
    )
    _package("optimum")
    _package("optimum.utils", logging=types.SimpleNamespace(get_logger=lambda *a: logging.getLogger("optimum")))
    _package("optimum.neuron")
    _package("optimum.neuron.utils")
    _package("optimum.neuron.utils.import_utils", is_peft_available=lambda: False)
    _package("optimum.neuron.models")
    _package("optimum.neuron.models.training")
    shards = _constant(src / f"{TRAINING}/modeling_utils.py", "MODEL_PARALLEL_SHARDS_DIR_NAME")
    _package("optimum.neuron.models.training.modeling_utils", MODEL_PARALLEL_SHARDS_DIR_NAME=shards)
    adapter = _constant(src / "optimum/neuron/peft/peft_model.py", "ADAPTER_MODEL_PARALLEL_SHARDS_DIR_NAME")
    _package("optimum.neuron.peft")
    _package("optimum.neuron.peft.peft_model", ADAPTER_MODEL_PARALLEL_SHARDS_DIR_NAME=adapter)
    modules = []
    for short in ("transformations_utils", "checkpointing"):
        name = f"optimum.neuron.models.training.{short}"
        spec = importlib.util.spec_from_file_location(name, src / f"{TRAINING}/{short}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


# ---- save: optimum-neuron's sharding of a Hugging Face Llama -------------------------------------


def _stages(layers: int, pp: int) -> list[range]:
    """NxD's pipeline partition of decoder layers: an even split, the remainder to the last stages."""
    base, extra = divmod(layers, pp)
    out, start = [], 0
    for stage in range(pp):
        count = base + (1 if stage >= pp - extra else 0)
        out.append(range(start, start + count))
        start += count
    return out


class _Param:
    """What optimum-neuron's code reads of a model parameter: NxD's tensor-parallel attributes."""

    def __init__(self, dim: int | None = None, stride: int = 1, tp: int = 1):
        if dim is not None:
            self.tensor_model_parallel, self.partition_dim, self.partition_stride = True, dim, stride
            self.num_partitions = tp


class _Model:
    """What optimum-neuron's `adapt_state_dict` and `create_parameter_metadata` read of a model:
    its named parameters (in LlamaForCausalLM's order), its custom modules with their specs, and
    the parameters of the current pipeline stage."""

    def __init__(self, params: dict, modules: dict, stage: set):
        self.params, self.modules, self.parameters_for_current_stage = params, modules, stage

    def named_parameters(self):
        return iter(self.params.items())

    def named_modules(self):
        return iter(self.modules.items())


def _llama(tu, cfg: dict, tp: int, fuse_qkv: bool, kv_multiplier: int | None):
    """The named parameters (with their attributes) and custom modules (with their specs) of
    optimum-neuron's LlamaForCausalLM, as its modeling code builds them."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qkv_linear = kv < tp or kv % tp != 0
    mult = (kv_multiplier or max(1, tp // kv)) if qkv_linear else 1
    params: dict[str, _Param] = {"model.embed_tokens.weight": _Param(0, 1, tp)}
    modules = {}
    for i in range(cfg["num_hidden_layers"]):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        modules[attn], modules[mlp] = tu.CustomModule(), tu.CustomModule()
        modules[attn].specs = tu.ModelWeightTransformationSpecs(module_fully_qualified_name=attn)
        if qkv_linear:
            names = ["weight_qkv"] if fuse_qkv else ["weight_q", "weight_k", "weight_v"]
            params.update({f"{attn}.qkv_proj.{n}": _Param(0, 1, tp) for n in names})
            modules[attn].specs.add_spec(
                tu.GQAQKVColumnParallelLinearSpec(
                    gqa_qkv_projection_name="qkv_proj",
                    query_projection_name="q_proj",
                    key_projection_name="k_proj",
                    value_projection_name="v_proj",
                    output_projection_name="o_proj",
                    num_attention_heads=heads,
                    num_key_value_heads=kv,
                    kv_size_multiplier=mult,
                    q_output_size_per_partition=heads * head_dim // tp,
                    kv_output_size_per_partition=kv * mult * head_dim // tp,
                    fuse_qkv=fuse_qkv,
                    bias=False,
                )
            )
        elif fuse_qkv and heads == kv:
            params[f"{attn}.qkv_proj.weight"] = _Param(0, 3, tp)
            modules[attn].specs.add_spec(
                tu.FusedLinearsSpec(
                    fused_linear_name="qkv_proj",
                    linear_names=["q_proj", "k_proj", "v_proj"],
                    bias=False,
                    fuse_axis="column",
                    original_dims=[heads * head_dim] * 3,
                )
            )
        else:
            params.update({f"{attn}.{p}.weight": _Param(0, 1, tp) for p in ("q_proj", "k_proj", "v_proj")})
        params[f"{attn}.o_proj.weight"] = _Param(1, 1, tp)
        params[f"{mlp}.gate_up_proj.weight"] = _Param(0, 2, tp)
        params[f"{mlp}.down_proj.weight"] = _Param(1, 1, tp)
        modules[mlp].specs = tu.ModelWeightTransformationSpecs(
            module_fully_qualified_name=mlp,
            specs=tu.FusedLinearsSpec(
                fused_linear_name="gate_up_proj",
                linear_names=["gate_proj", "up_proj"],
                bias=False,
                fuse_axis="column",
                original_dims=[cfg["intermediate_size"]] * 2,
            ),
        )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params[f"model.layers.{i}.{norm}.weight"] = _Param()
    params["model.norm.weight"] = _Param()
    params["lm_head.weight"] = _Param(0, 1, tp)
    return params, modules


def _in_stage(name: str, stage: int, layers: range, pp: int) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) in layers
    return stage == 0 if name.startswith("model.embed_tokens") else stage == pp - 1


def save(
    hf_dir: Path,
    out: Path,
    tp: int,
    pp: int,
    fuse_qkv: bool,
    kv_multiplier: int | None,
    optim: str | None = None,
    grads_file: Path | None = None,
) -> None:
    """Every rank's state dict made by optimum-neuron's `adapt_state_dict` (as its from_pretrained
    shards a Hugging Face model) and its metadata by `create_parameter_metadata` (as its
    save_pretrained writes mp_metadata_pp_rank_P.json); with `optim`, the optimizer files too."""
    from safetensors.torch import load_file, save_file

    tu, _ = load()
    cfg = json.loads((hf_dir / "config.json").read_text())
    full = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        full.update(load_file(str(f)))
    grads = [_full_grads(full, step) for step in range(_STEPS)] if optim else []
    kind, xser = (optim or "").removesuffix("+xser"), (optim or "").endswith("+xser")
    write = _xser_save if xser else torch.save
    _NxD.size = tp
    params, modules = _llama(tu, cfg, tp, fuse_qkv, kv_multiplier)
    shards = out / "shards"
    (shards / "model").mkdir(parents=True)
    (shards / "checkpoint").write_text("1")
    for stage, layers in enumerate(_stages(cfg["num_hidden_layers"], pp)):
        model = _Model(params, modules, {n for n in params if _in_stage(n, stage, layers, pp)})

        def local(
            tensors: dict, stage=stage, layers=layers, model=model
        ) -> dict:  # this tp rank's tensors of the stage, by optimum-neuron's own sharding
            state = {n: w.clone() for n, w in tensors.items() if _in_stage(n, stage, layers, pp)}
            state = tu.adapt_state_dict(model, state, {}, inplace=False)
            ordered = {n: state[n].contiguous() for n in params if n in model.parameters_for_current_stage}
            assert set(ordered) == set(state), sorted(set(state) ^ set(ordered))
            return ordered

        for t in range(tp):
            _NxD.rank = t
            ordered = local(full)
            write(ordered, shards / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{stage:02d}.pt")
            if optim:
                (shards / "optim").mkdir(exist_ok=True)
                for name, obj in _optimizer_files(ordered, [local(g) for g in grads], kind, t, stage).items():
                    write(obj, shards / "optim" / name)
        metadata = tu.create_parameter_metadata(model)
        (shards / f"mp_metadata_pp_rank_{stage}.json").write_text(json.dumps(metadata, indent=4))
    (shards / "done").write_text("1")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if optim:
        _trainer_files(out)
        save_file({f"step{k}.{n}": g for k, step in enumerate(grads) for n, g in step.items()}, str(grads_file))


# ---- the optimizer state of optimum-neuron's NeuronTrainer ---------------------------------------
#
# What the trainer saves (optimum-neuron 0.4.5 trainers/transformers.py `_save_checkpoint` and
# `save_model`, models/training/modeling_utils.py `save_pretrained`): the model and optimizer go
# through NxD's `trainer.save_checkpoint(dir, tag="shards", model=..., optimizer=self.optimizer)`.
# `self.optimizer` is accelerate's wrapper (NeuronAcceleratedOptimizer), whose state_dict() is the
# wrapped optimizer's, and which is neither an NxDOptimizer nor a NeuronZero1Optimizer: NxD's
# save_checkpoint therefore takes its non-ZeRO path, one file per (tp, pp) rank named with dp rank
# 00, written by the first rank of each data-parallel group. The wrapped optimizer is torch's AdamW
# (zero_1 off: its state_dict) or NxD's NeuronZero1Optimizer (zero_1 on, the default in 0.4: torch-xla's
# ZeroRedundancyOptimizer.state_dict(), {state: {}, param_groups, base_state, shape_info}, the
# moments being this dp rank's zero-padded dim-0 chunk). Neither NxD nor torch-xla runs here, so the
# files are built from torch's own AdamW state_dict in those shapes; at dp 2 the file keeps dp rank
# 0's chunk (with xser NxD would even mix the dp ranks' chunks, tensor by tensor).

_STEPS = 2
_NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm")


def _full_grads(full: dict, step: int) -> dict:
    """Seeded gradients of the full model, one per Hugging Face tensor, fp32."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(w.shape, generator=gen, dtype=torch.float32) for n, w in sorted(full.items())}


def _adamw(names: list, weights: dict, grads: list) -> torch.optim.AdamW:
    """torch's AdamW over a stage's parameters in the trainer's two groups (create_optimizer: decay,
    then no decay; LlamaRMSNorm is in ALL_LAYERNORM_LAYERS, so the norms take no decay), stepped
    over `grads`."""
    tensors = {n: torch.nn.Parameter(weights[n].float()) for n in names}
    no_decay = [n for n in names if any(k in n for k in _NORMS)]
    groups = [
        {"params": [tensors[n] for n in names if n not in no_decay], "weight_decay": 0.01},
        {"params": [tensors[n] for n in no_decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, foreach=False)
    for step in grads:
        for n in names:
            tensors[n].grad = step[n]
        opt.step()
    return opt


def _optimizer_files(weights: dict, grads: list, optim: str, tp: int, pp: int) -> dict:
    """The files NxD's save_checkpoint writes under shards/optim/ for this (tp, pp) rank."""
    names = list(weights)
    state = _adamw(names, weights, grads).state_dict()
    name = f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
    if optim == "adamw":
        return {name: state}
    dp = 2 if optim == "zero1-dp2" else 1
    order = [i for g in state["param_groups"] for i in g["params"]]
    shapes = [weights[n].shape for n in names if not any(k in n for k in _NORMS)]
    shapes += [weights[n].shape for n in names if any(k in n for k in _NORMS)]

    def chunk0(t: torch.Tensor) -> torch.Tensor:  # dp rank 0's ZeRO-1 chunk: dim 0 padded to a multiple of dp
        rows = -(-t.shape[0] // dp)
        return t[:rows].clone()

    base = {
        i: {
            "step": state["state"][i]["step"],
            "exp_avg": chunk0(state["state"][i]["exp_avg"]),
            "exp_avg_sq": chunk0(state["state"][i]["exp_avg_sq"]),
        }
        for i in order
    }
    return {
        name: {
            "state": {},
            "param_groups": state["param_groups"],
            "base_state": base,
            "shape_info": {i: list(shapes[i]) for i in order},
        }
    }


class _TensorReference:
    """torch-xla's xser placeholder (torch_xla.utils.serialization.TensorReference: one int, tid)."""

    def __init__(self, tid: int):
        self.tid = tid


_TensorReference.__module__, _TensorReference.__qualname__ = "torch_xla.utils.serialization", "TensorReference"
_TensorReference.__name__ = "TensorReference"


def _xser_save(obj, path: Path) -> None:
    """torch-xla's xser.save as NxD's save_checkpoint uses it: every tensor, depth first in dict
    order, becomes TensorReference(tid) in PATH and is saved alone as PATH.tensors/tensor_<tid>.pt;
    NxD adds PATH.info.pt ({tid: dtype, shape, expert_model_parallel})."""
    for name in ("torch_xla", "torch_xla.utils"):
        _package(name)
    _package("torch_xla.utils.serialization", TensorReference=_TensorReference)
    folder = Path(str(path) + ".tensors")
    folder.mkdir()
    info = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            tid = len(info)
            torch.save(x.clone(), folder / f"tensor_{tid}.pt")
            info[tid] = {"dtype": x.dtype, "shape": x.shape, "expert_model_parallel": False}
            return _TensorReference(tid)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    torch.save(walk(obj), path)
    torch.save(info, str(path) + ".info.pt")


def _trainer_files(out: Path) -> None:
    """What `_save_checkpoint` writes beside shards/: the scheduler's state_dict (torch's LambdaLR,
    as transformers' linear schedule is) and the TrainerState as JSON."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 10)
    for _ in range(_STEPS):
        opt.step()
        scheduler.step()
    torch.save(scheduler.state_dict(), out / "scheduler.pt")
    state = {"global_step": _STEPS, "epoch": 0.5, "max_steps": 10, "log_history": [{"loss": 1.5, "step": _STEPS}]}
    (out / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> None:
    if argv[0] == "consolidate":
        _, checkpointing = load()
        checkpointing.consolidate_model_parallel_checkpoints_to_unified_checkpoint(Path(argv[1]), Path(argv[2]))
    elif argv[0] == "fetch":
        fetch(Path(argv[1]))
    elif argv[0] == "save":
        tp, pp, fuse, mult = int(argv[3]), int(argv[4]), argv[5] == "1", int(argv[6])
        optim, grads = (argv[7], Path(argv[8])) if len(argv) > 7 else (None, None)
        save(Path(argv[1]), Path(argv[2]), tp, pp, fuse, mult or None, optim, grads)
    else:
        raise SystemExit(f"unknown command {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
