"""No module of shardkit/ keeps a module-level registry of open things (descriptors, files, mirrors,
sinks): what belongs to an open file or an output is state of the object that opened it, so that
nothing outlives it or leaks to another run in the same process.

Every module is read with `ast`. A candidate is a name bound at module level to a mutable
container (`{}`, `[]`, `set()`, `dict()`, `list()`, a comprehension, `defaultdict(...)`,
`OrderedDict()`, `deque()`, `WeakValueDictionary()`, ...). It is flagged when code inside a
function, in any module, mutates it (a mutating method, an item assigned or deleted, `+=` on an
item): state that changes while the program runs. A table filled only as its module is imported
(a loop at module level) is a constant and is not flagged.

What this cannot see: state rebound with `global NAME` (a module-level tuple or object replaced
by a function), state inside a module-level object (an instance whose attributes are dicts, a
`threading.local`, a class attribute), a container reached under another name (an alias) or
mutated through a local variable bound to it. Those are left to review.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "shardkit"

CONTAINERS = {
    "dict",
    "set",
    "list",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "ChainMap",
    "deque",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
}
"""Calls that make a mutable container (by the name called, plain or as `module.name`)."""

MUTATORS = {
    "add",
    "append",
    "appendleft",
    "clear",
    "difference_update",
    "discard",
    "extend",
    "extendleft",
    "insert",
    "intersection_update",
    "move_to_end",
    "pop",
    "popitem",
    "popleft",
    "remove",
    "setdefault",
    "symmetric_difference_update",
    "update",
}

NOT_REGISTRIES = {
    "shardkit/families/base.py:REGISTRY": "model_type -> family, filled by `register` as family modules are imported",
    "shardkit/families/base.py:_LAYER_RES": "compiled layer patterns, rebuilt when the family table grows",
    "shardkit/formats/torch_metadata.py:_METADATA_CACHE": "parsed metadata by file identity (a bounded cache)",
    "shardkit/formats/torch_io.py:_KEPT": "failed torch zip writers that must never be destroyed (it would abort)",
    "shardkit/io/data/digest.py:_RECORDING_BLOCKS": "the depth of `recording_blocks` blocks (a counter)",
    "shardkit/io/objects/streamed.py:_FALLOCATE": "libc's fallocate, looked up once",
    "shardkit/memory.py:_PRICINGS": "memory prices of placements (a cache of pure computations)",
}
"""Module state that changes at run time and is no registry of open things, with why."""


def _called_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_container(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _called_name(value.func) in CONTAINERS


def module_containers(tree: ast.Module) -> set[str]:
    """Names bound at module level (the module's own statements) to a mutable container."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _is_container(value):
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def _named(node: ast.expr) -> str | None:
    """The container a mutation reaches: `NAME` or `module.NAME`."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def mutated_in_functions(tree: ast.Module) -> set[str]:
    """Names (plain or as an attribute) whose container code inside a function mutates."""
    found: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                name = _named(node.func.value)
            elif isinstance(node, (ast.Assign, ast.Delete)):
                name = next((_named(t.value) for t in node.targets if isinstance(t, ast.Subscript)), None)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Subscript):
                name = _named(node.target.value)
            else:
                continue
            if name is not None:
                found.add(name)
    return found


def registries(modules: Iterable[tuple[str, ast.Module]]) -> set[str]:
    """`path:NAME` of every module-level container some function mutates."""
    trees = list(modules)
    mutated: set[str] = set()
    for _, tree in trees:
        mutated |= mutated_in_functions(tree)
    return {f"{where}:{name}" for where, tree in trees for name in module_containers(tree) if name in mutated}


def _package() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def test_no_module_keeps_a_registry_of_open_things():
    found = registries(_package())
    new = sorted(found - set(NOT_REGISTRIES))
    assert not new, (
        "module-level containers changed at run time: make them state of the object that opens or owns "
        f"what they hold (or, if one is truly no registry of open things, list it in NOT_REGISTRIES with why): {new}"
    )
    gone = sorted(set(NOT_REGISTRIES) - found)
    assert not gone, f"no longer module state: remove them from NOT_REGISTRIES: {gone}"


def test_the_check_catches_what_it_claims():
    """Negative controls: a table of descriptors filled by a function (here, and through the
    module's name elsewhere) is found; a table filled at import only, and a local table, are not."""
    opened = ast.parse(
        "import os\n_OPEN: dict[int, str] = {}\n_HELD = set()\n_TABLE = dict(a=1)\n"
        "for k in 'bc':\n    _TABLE[k] = 2\n"
        "def open_(path):\n    fd = os.open(path, 0)\n    _OPEN[fd] = path\n    local = {}\n    local[fd] = 1\n"
        "    return fd\n"
    )
    other = ast.parse("from . import opened\ndef hold(fd):\n    opened._HELD.add(fd)\n")
    assert registries([("opened.py", opened), ("other.py", other)]) == {"opened.py:_OPEN", "opened.py:_HELD"}
    assert registries([("opened.py", opened)]) == {"opened.py:_OPEN"}
