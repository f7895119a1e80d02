"""The package's imports run one way, down the layers of docs/ARCHITECTURE.md, with no cycle.

Every module of `shardkit/` is read with `ast` (imports inside functions count too; imports
under `if TYPE_CHECKING:` do not, since they never run). An import of a package's own face
(`from . import X` where X is not a submodule, `from ..families import Family`) is an edge to
that package's `__init__`, so a cycle through a face is found as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "shardkit"

# Top to bottom. A module may import modules of its own layer or of any layer below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("public face", ("shardkit", "shardkit.__main__")),
    ("cli", ("shardkit.cli",)),
    ("api", ("shardkit.api",)),
    ("hub", ("shardkit.hub",)),
    ("training checkpoints", ("shardkit.checkpoint",)),
    ("engine", ("shardkit.engine",)),
    ("memory planning", ("shardkit.memory",)),
    ("formats", ("shardkit.formats",)),
    ("conventions", ("shardkit.conventions",)),
    ("families", ("shardkit.families",)),
    ("placements", ("shardkit.placements",)),
    ("layout", ("shardkit.layout",)),
    ("io", ("shardkit.io",)),
    (
        "foundation",
        (
            "shardkit.distributed",
            "shardkit.paths",
            "shardkit.sizes",
            "shardkit.errors",
            "shardkit.version",
            "shardkit.testing",
            "shardkit.torch_compat",
        ),
    ),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The shardkit modules `name` imports (a package face counts as the package itself)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "shardkit" or alias.name.startswith("shardkit."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                if node.module:
                    base += node.module.split(".")
                target = ".".join(base)
            else:
                target = node.module or ""
            if not (target == "shardkit" or target.startswith("shardkit.")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules}


def layer_of(name: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{name} belongs to no layer: add it to LAYERS (and docs/ARCHITECTURE.md)")
    return best[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    for name in graph:
        layer_of(name)


def test_no_import_goes_up_a_layer(graph):
    upward = []
    for name, targets in graph.items():
        for target in targets:
            if layer_of(target) < layer_of(name):
                upward.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_catch_what_they_claim():
    """Negative controls: a cycle through a package face and an upward import are found."""
    assert find_cycle({"a": {"b"}, "b": {"a.face"}, "a.face": {"a"}}) == ["a", "b", "a.face", "a"]
    assert layer_of("shardkit.engine.staging") < layer_of("shardkit.formats.nxd")
    modules = all_modules()
    family = imports_of("shardkit.families.llama", modules["shardkit.families.llama"], modules)
    assert "shardkit.families.base" in family and "shardkit.families" not in family


# ---- sizes a reader can hold in mind ------------------------------------------------------------------

MODULE_MAX_LINES = 900
FUNCTION_MAX_LINES = 100


def _sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "trainer").rglob("*.py")])


def test_no_module_over_900_lines():
    big = {str(p.relative_to(ROOT)): n for p in _sources() if (n := p.read_text().count("\n")) > MODULE_MAX_LINES}
    assert not big, f"split these modules by concern: {big}"


def test_no_function_over_100_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_MAX_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = length
    assert not long, f"split these functions by step: {long}"
