"""The `shardkit` command: a thin click shell over the library (parse, call, print).

Laid out like huggingface_hub's CLI: `main` holds the root group and error handling, `options`
the shared options and printers, and one module per group of commands (convert, inspect, plan,
ckpt, hub). Command modules never import `main`; `main` adds their commands.

This package's face imports nothing itself: the console script imports it and then calls `main`,
which imports the commands inside its Ctrl-C handler, so an interrupt at any moment of the start
(click, torch and transformers take about a second to import) ends the command with one line and
exit code 130, never a traceback.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .main import cli

__all__ = ["cli", "main"]

INTERRUPTED = 130


def main() -> None:
    """The console script: run the `shardkit` command; Ctrl-C is one line and exit 130."""
    try:
        _lean_start(_commands).main()
    except KeyboardInterrupt:
        print("shardkit: interrupted; nothing was left behind", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)


_MAIN = main


def _lean_start(start: Callable[[], ModuleType]) -> ModuleType:
    """`start()` with the cyclic garbage collector off, then everything it imported frozen.

    Start-up (torch, click, the commands) creates a few hundred thousand objects that live as long
    as the process: each full collection would walk them all again (100-200 ms each, two or three
    in a start and one more at exit) to free nothing. Frozen, the collector no longer visits them;
    whatever the command then allocates is collected as usual."""
    gc.disable()
    try:
        return start()
    finally:
        gc.freeze()
        gc.enable()


def _commands() -> ModuleType:
    """The `main` module (the root group and every command), imported on first use. Importing it
    binds this package's name `main` to the module; it is given back to the function above."""
    module = importlib.import_module(f"{__name__}.main")
    globals()["main"] = _MAIN
    return module


def __getattr__(name: str) -> Any:
    if name == "cli":
        return _commands().cli
    raise AttributeError(f"module 'shardkit.cli' has no attribute {name!r}")
