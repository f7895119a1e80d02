"""Object storage enters the code above `shardkit/io/` through one seam, `shardkit.io.store`.

Every module of `shardkit/` outside `io/`, and of `trainer/`, is read with `ast`; an import of
`shardkit.io.objects` (the S3 backend, mirrors, uploads, published records) from any of
them fails the test, imports inside functions included. A new backend (gs://, fsspec) then needs
no change above `io/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OBJECTS = "shardkit.io.objects"

STILL_DIRECT: dict[str, str] = {
    # module -> why it still imports io.objects (none: the sinks that take a save's closed files are
    # handed down to its writers, `io.safety.sinks`)
}


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> set[str]:
    name = _module(path)
    package = name if path.name == "__init__.py" else name[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            else:
                base = (node.module or "").split(".")
            target = ".".join(base)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _callers() -> dict[str, set[str]]:
    files = [p for p in (ROOT / "shardkit").rglob("*.py") if (ROOT / "shardkit" / "io") not in p.parents]
    files += list((ROOT / "trainer").rglob("*.py"))
    return {".".join(_module(p)): _imports(p) for p in files}


def test_nothing_above_io_imports_the_object_storage_backend():
    direct = {
        module: sorted(t for t in targets if t == OBJECTS or t.startswith(OBJECTS + "."))
        for module, targets in _callers().items()
    }
    offending = {m: t for m, t in direct.items() if t and m not in STILL_DIRECT}
    assert not offending, f"go through shardkit.io.store instead: {offending}"


def test_the_list_of_exceptions_is_current():
    callers = _callers()
    stale = [m for m in STILL_DIRECT if not any(t.startswith(OBJECTS) for t in callers.get(m, ()))]
    assert not stale, f"these no longer import io.objects: remove them from STILL_DIRECT: {stale}"


def test_the_check_sees_an_import_of_the_backend(tmp_path, monkeypatch):
    probe = ROOT / "shardkit" / "engine" / "executor.py"
    assert any(t.startswith("shardkit.io") for t in _imports(probe))
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from ..io.objects import s3\n")
    monkeypatch.setattr(
        "test_store_seam._module", lambda path: ["shardkit", "engine", "m"] if path == fake else _module(path)
    )
    assert "shardkit.io.objects.s3" in _imports(fake)
