"""The `shardkit` command: a thin click shell over the library (parse, call, print).

Laid out like huggingface_hub's CLI: `main` holds the root group and error handling, `options`
the shared options and printers, and one module per group of commands (convert, inspect, plan,
ckpt, hub). Command modules never import `main`; `main` adds their commands.
"""

from .main import cli, main

__all__ = ["cli", "main"]
