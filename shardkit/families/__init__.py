"""Model families, one small module each, found by looking: every module in this package that
calls `register(Family(...))` is a family. Adding a model is writing one module; nothing here
lists them. `lora.py` is the exception: LoRA adapters' families are built from an adapter
checkpoint's config (its LoRA section) when `family_for` meets one.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedModelError
from . import lora
from .base import LAYER_PREFIX, REGISTRY, Family, layer_of, register

__all__ = ["Family", "LAYER_PREFIX", "family_for", "known_families", "layer_of", "register"]

_loaded = False


def known_families() -> dict[str, Family]:
    """model_type -> family, importing every family module of this package once."""
    global _loaded
    if not _loaded:
        for module in pkgutil.iter_modules(__path__):
            if module.name not in ("base", "lora"):
                importlib.import_module(f"{__name__}.{module.name}")
        _loaded = True
    return dict(REGISTRY)


def family_for(config: Mapping[str, Any]) -> Family:
    """The family of a Hugging Face config dict, or UnsupportedModelError naming the known ones;
    the variant of its table that the config's `architectures` asks for (BERT's classification
    model, its bare encoder), when the family has variants. A config with a LoRA section (an
    adapter checkpoint's) gets its adapters' family, built from its base model's family (`lora.py`)."""
    if lora.LORA_KEY in config:
        return lora.adapter_family(family_for(lora.base_config(config)), config)
    registry = known_families()
    model_type = str(config.get("model_type", ""))
    if model_type not in registry:
        known = ", ".join(sorted(k for k in registry if not k.startswith(lora.LORA_KEY)))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (known: {known}); "
            "add a family module in shardkit/families/ to support it"
        )
    family = registry[model_type]
    chosen = family.variant(config) if family.variant is not None else None
    return chosen or family
