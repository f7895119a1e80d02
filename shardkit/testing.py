"""Helpers for tests, benchmarks and the demo: tiny random Hugging Face models from fixtures/."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def fixture_config(name: str) -> dict:
    """A config from fixtures/ by name (without .json)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def make_tiny_model(
    config: str | dict,
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Build a seeded random model with transformers from a config and save it as an HF directory.

    Weights are drawn with a larger spread than transformers' init so that mistakes in head order
    change outputs visibly."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = fixture_config(config) if isinstance(config, str) else dict(config)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg_dict.items() if k != "architectures"})
    torch.manual_seed(seed)
    arch = (cfg_dict.get("architectures") or [""])[0]
    if arch and not arch.endswith("ForCausalLM"):  # an encoder's pre-training class (BertForPreTraining)
        model = getattr(transformers, arch)(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(dtype)
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir
