"""shardkit's slim trainer: tensor, pipeline, data and expert parallel training of decoder LLMs on
torch.distributed (gloo, nccl) or torch-xla (Trainium), consuming sharded (NxD) or Hugging Face
checkpoints of any layout.

    torchrun --nproc-per-node 8 -m trainer --model ./llama-tp2pp2 --data ./tokens.bin \\
        --tp 2 --pp 2 --dp 2 --zero1 --global-batch 16 --seq-len 2048 --steps 1000

or, as a library, `trainer.train(TrainConfig(...))` inside each process of the job.

Modules: `config` (the options), `plan` (checking them before the job starts), `parallel` (the
rank's grid coordinates, device and groups), `comm` (the one communication interface: gloo/nccl
through torch.distributed, torch-xla), `layers` (tensor-parallel layers and the vocab-parallel
loss), `model` (a decoder built from one rank's pieces), `pipeline` (1F1B with
torch.distributed.pipelining), `exchange` (the XLA path's pipeline by neighbour exchanges), `optim`
(master weights, ZeRO-1, clipping), `data` (token files and the sample order), `sources` and
`tokenizing` (text data read and tokenized into a cached token file), `weights` (loading
pieces, --export-hf), `checkpointing` (shardkit.checkpoint), `cpus` (CPU threads), `loop` (the run).
"""

import os

from .cpus import choose_waiting

# OpenMP threads that spin while they wait slow a run many times over on a host busy with other work,
# and are the fastest on a dedicated one (trainer/cpus.py); the runtime reads how they wait once, when
# torch loads it, so this comes before torch is imported
choose_waiting(os.environ)

from .config import TrainConfig, parse_args  # noqa: E402 - after the OpenMP setting above
from .errors import DataError, TrainerError  # noqa: E402
from .loop import Summary, train  # noqa: E402

__all__ = ["TrainConfig", "parse_args", "train", "Summary", "TrainerError", "DataError"]
