"""Helpers of the meaning tests (tests/system/meaning/test_roundtrip.py,
tests/system/golden/test_dcp.py): transformers' logits of a model folder on fixed token ids."""

from __future__ import annotations

from pathlib import Path

import torch


def _logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits


def _input_ids(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (2, 11), generator=generator)
