"""The trainer's communication interface (`base.py`) and its implementations: torch.distributed
(`torch_dist.py`: gloo, nccl) and torch-xla (`xla.py`, with `threads.py` for several devices in
one process). torch-xla is imported only on the XLA path."""

from .base import Comm, Group

__all__ = ["Comm", "Group"]
