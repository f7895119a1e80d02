"""Mistral (model_type "mistral"): Llama's table exactly; sliding-window attention changes
nothing about the weights."""

import dataclasses

from .base import register
from .llama import FAMILY as LLAMA

FAMILY = register(dataclasses.replace(LLAMA, name="mistral", model_types=("mistral",)))
