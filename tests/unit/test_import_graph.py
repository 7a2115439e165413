"""The import graph of ``ledgerbox``: no cycle, and the layers of STYLE rule 6.

Every module under ``ledgerbox/`` is parsed (AST, no import is executed), and EVERY import
statement counts: top-level ones, those under ``if TYPE_CHECKING:`` and those inside functions,
because a cycle hidden from the interpreter is still a cycle in the design. An edge goes to the
module an import names: ``from ledgerbox.inbox import _consumer`` is an edge to
``ledgerbox.inbox._consumer`` (a submodule), ``from ledgerbox.inbox import InboxConsumer`` one
to ``ledgerbox.inbox`` (a name of the package). The parent packages an import executes on the
way are not edges: otherwise every package whose ``__init__`` re-exports its submodules would
count as a cycle. Imports by string (``importlib.import_module(name)``) are not seen.

Layers (the house style's rule 6): ``_core`` imports no other
subpackage; ``outbox`` only itself and ``_core``; ``relay`` and ``inbox`` may import ``outbox``
and ``_core`` but never each other; ``admin`` (the operator API) may import ``relay``,
``inbox``, ``outbox`` and ``_core``; ``migrations`` may import the table modules of the four
(``_table``, and ``outbox._types``, their column types); nothing but ``ledgerbox.cli``
imports ``migrations``.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import ledgerbox

ROOT = Path(ledgerbox.__file__).resolve().parent  # the symlinked subpackages are followed

Graph = dict[str, set[str]]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every ``.py`` file under ``root`` by dotted module name (``pkg/__init__.py`` is ``pkg``)."""
    found: dict[str, Path] = {}
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        parts = ["ledgerbox", *Path(folder).relative_to(root).parts]
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            dotted = ".".join(parts if stem == "__init__" else [*parts, stem])
            found[dotted] = Path(folder) / name
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve_from(module: str, path: Path, node: ast.ImportFrom) -> str:
    # ``from ..x import y`` in module a.b.c (a file): level 2 climbs from package a.b to a.
    if node.level == 0:
        return node.module or ""
    base = _package_of(module, path).split(".")
    if node.level - 1 > len(base) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The ledgerbox modules that ``module`` (source at ``path``) imports, wherever in it."""
    known = set(modules)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, path, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                # ``from pkg import x``: the submodule pkg.x if there is one, else a name of pkg.
                targets.add(submodule if submodule in known else source)
    return {t for t in targets if t in known and t != module}


def import_graph(files: Mapping[str, Path] | None = None) -> Graph:
    """Edges ``importer -> imported`` between ledgerbox modules."""
    files = module_files() if files is None else files
    return {module: imports_of(module, path, files) for module, path in files.items()}


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Cycles among ``graph``'s modules, each as a path ``[a, b, ..., a]``: the strongly
    connected components with more than one module (Tarjan), and in each the shortest cycle
    through each member (the same set of modules reported once). Empty: no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(start: str) -> None:
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: set[str] = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles: list[list[str]] = []
    for component in components:
        for member in sorted(component):
            cycle = _cycle_in(graph, component, member)
            if not any(set(cycle) == set(seen) for seen in cycles):
                cycles.append(cycle)
    return cycles


def _cycle_in(graph: Mapping[str, set[str]], component: set[str], start: str) -> list[str]:
    # The shortest way from ``start`` back to itself, inside the component (BFS).
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(graph.get(node, set()) & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def layer_of(module: str) -> str:
    """``_core``, ``outbox``, ``relay``, ``inbox``, ``admin``, ``migrations``, ``cli`` or
    ``root``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else "root"


#: Which layers each layer may import (itself always).
ALLOWED: dict[str, set[str]] = {
    "_core": set(),
    "outbox": {"_core"},
    "relay": {"outbox", "_core"},
    "inbox": {"outbox", "_core"},
    "migrations": {"_core"},  # and the table modules, see TABLE_MODULES
    "telemetry": {"_core"},  # ledgerbox.telemetry: the public face of _core.telemetry
    # The operator API acts on the relay's and the inbox's tables and topics.
    "admin": {"outbox", "relay", "inbox", "_core"},
    # The ops console reads and acts through the operator API only.
    "console": {"admin", "_core"},
    "cli": {"outbox", "relay", "inbox", "admin", "console", "migrations", "_core", "root"},
    "root": {"_core", "cli", "telemetry"},
}
TABLE_MODULES = {
    "ledgerbox.outbox._table",
    "ledgerbox.outbox._types",  # the column types of the table modules (xid8, pg_snapshot)
    "ledgerbox.inbox._table",
    "ledgerbox.relay._table",
    "ledgerbox.admin._table",
}


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Every edge that crosses the layers against :data:`ALLOWED`, as ``"a -> b"``."""
    bad: list[str] = []
    for importer, imported in sorted(graph.items()):
        mine = layer_of(importer)
        for target in sorted(imported):
            theirs = layer_of(target)
            if theirs == mine or theirs in ALLOWED[mine]:
                continue
            if mine == "migrations" and target in TABLE_MODULES:
                continue
            bad.append(f"{importer} ({mine}) -> {target} ({theirs})")
    return bad


def _cycles_text(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


# -- the rules on this repository ----------------------------------------------------------


def test_every_subpackage_is_parsed() -> None:
    files = module_files()
    for package in ("_core", "outbox", "relay", "inbox", "migrations"):
        assert f"ledgerbox.{package}" in files, package
    assert "ledgerbox.inbox._consumer" in files and "ledgerbox.cli" in files
    assert import_graph(files)["ledgerbox.inbox"] >= {"ledgerbox.inbox._consumer"}


def test_no_import_cycle() -> None:
    """No cycle among ledgerbox modules, counting TYPE_CHECKING and function-level imports."""
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + _cycles_text(cycles)


def test_layers() -> None:
    """_core < outbox < relay, inbox (apart); migrations on table modules; only the CLI
    imports migrations."""
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_only_the_cli_imports_migrations() -> None:
    graph = import_graph()
    importers = {
        importer
        for importer, imported in graph.items()
        if layer_of(importer) != "migrations" and any(layer_of(t) == "migrations" for t in imported)
    }
    assert importers <= {"ledgerbox.cli"}, sorted(importers)


def test_inbox_steps_do_not_import_the_consumer() -> None:
    """Only ``ledgerbox.inbox`` (``__init__``) and its CLI import ``_consumer`` (STYLE rule 15:
    the steps get a small deps object, not the consumer)."""
    graph = import_graph()
    importers = {m for m, imported in graph.items() if "ledgerbox.inbox._consumer" in imported}
    assert importers <= {"ledgerbox.inbox", "ledgerbox.inbox._cli"}, sorted(importers)


# -- the checker on small trees, so that it can fail ---------------------------------------


def _tree(tmp_path: Path, files: Mapping[str, str]) -> dict[str, Path]:
    root = tmp_path / "ledgerbox"
    for rel, source in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source, encoding="utf-8")
    return module_files(root)


def test_checker_sees_type_checking_function_level_and_relative_imports(tmp_path: Path) -> None:
    files = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "inbox/__init__.py": "from ledgerbox.inbox._consumer import InboxConsumer\n",
            "inbox/_consumer.py": "from ._message import Pipeline\n",
            "inbox/_message.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from ledgerbox.inbox._consumer import InboxConsumer\n"
                "def f():\n"
                "    from .. import outbox\n"
                "    from ..outbox import _writer, EventEnvelope\n"
                "    import ledgerbox.relay._relay\n"
            ),
            "outbox/__init__.py": "",
            "outbox/_writer.py": "",
            "relay/__init__.py": "",
            "relay/_relay.py": "",
        },
    )
    graph = import_graph(files)
    assert graph["ledgerbox.inbox"] == {"ledgerbox.inbox._consumer"}
    assert graph["ledgerbox.inbox._consumer"] == {"ledgerbox.inbox._message"}
    assert graph["ledgerbox.inbox._message"] == {
        "ledgerbox.inbox._consumer",  # under TYPE_CHECKING
        "ledgerbox.outbox",  # `from .. import outbox` names the submodule; EventEnvelope a name
        "ledgerbox.outbox._writer",
        "ledgerbox.relay._relay",
    }
    assert find_cycles(graph) == [
        ["ledgerbox.inbox._consumer", "ledgerbox.inbox._message", "ledgerbox.inbox._consumer"]
    ]
    assert layer_violations(graph) == [
        "ledgerbox.inbox._message (inbox) -> ledgerbox.relay._relay (relay)"
    ]


def test_checker_reports_a_long_cycle_and_the_layers(tmp_path: Path) -> None:
    files = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "_core/__init__.py": "",
            "_core/a.py": "from ledgerbox._core import b\n",
            "_core/b.py": "from ledgerbox._core.c import x\n",
            "_core/c.py": "import ledgerbox._core.a\nfrom ledgerbox.outbox import y\n",
            "outbox/__init__.py": "from ledgerbox.migrations import z\n",
            "migrations/__init__.py": "from ledgerbox.inbox._table import T\n",
            "inbox/__init__.py": "",
            "inbox/_table.py": "",
        },
    )
    graph = import_graph(files)
    assert find_cycles(graph) == [
        ["ledgerbox._core.a", "ledgerbox._core.b", "ledgerbox._core.c", "ledgerbox._core.a"]
    ]
    assert layer_violations(graph) == [
        "ledgerbox._core.c (_core) -> ledgerbox.outbox (outbox)",
        "ledgerbox.outbox (outbox) -> ledgerbox.migrations (migrations)",
    ]
