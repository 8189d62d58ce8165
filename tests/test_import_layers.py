"""Imports point down: every import in megalite/ against the layer table of
docs/architecture.md (section 1), which is the rule (docs/design.md §12); and the folders
too: no two folders of megalite/ import each other, directly or around a loop.

A module may import from its own layer or a lower one (a higher row number), never from a
higher one, and no modules import each other around a loop. Imports inside functions count
as much as those at the top of a file. Importing `a.b.c` also runs the packages `a.b`
above it: a package `__init__.py` that itself imports megalite modules counts as imported.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megalite"
TABLE_PAGE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(source: str, module: str, is_package: bool,
                   modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported megalite module, line) for every import statement of `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
    return [(name, line) for name, line in found
            if name == "megalite" or name.startswith("megalite.")]


def import_graph(modules: dict[str, Path],
                 extra: dict[str, str] | None = None) -> dict[str, list[tuple[str, int]]]:
    """module -> the megalite modules it imports (with the line); `extra` adds source lines
    to a module (how the tests below plant a bad import)."""
    graph = {}
    for name, path in modules.items():
        source = path.read_text() + "\n" + (extra or {}).get(name, "")
        graph[name] = imported_names(source, name, path.name == "__init__.py", modules)
    return graph


def with_parent_packages(graph: dict[str, list[tuple[str, int]]]):
    """Each import plus the packages above its target whose __init__ imports megalite code
    (running that import runs them too)."""
    active = {name for name, targets in graph.items() if targets}
    out = {}
    for name, targets in graph.items():
        edges = list(targets)
        for target, line in targets:
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in active and not name.startswith(package + ".") and name != package:
                    edges.append((package, line))
        out[name] = edges
    return out


def layer_table(page: Path = TABLE_PAGE) -> dict[str, int]:
    """Path (file or folder, relative to the repository) -> layer number, from the rows
    `| n | name | `files` ... |` of section 1 of the page."""
    text = page.read_text()
    section = text[text.index("## 1. "):text.index("## 2. ")]
    table = {}
    for row in re.finditer(r"^\| (\d+) \| [^|]+ \| ([^|]+) \|", section, re.M):
        for path in re.findall(r"`([^`]+)`", row.group(2)):
            if path in table:
                raise AssertionError(f"{path} is in two rows of {page}'s layer table")
            table[path] = int(row.group(1))
    return table


def layer_of(path: Path, table: dict[str, int]) -> int | None:
    """The row of the most specific entry naming `path`: the file itself, else the
    innermost folder listed."""
    rel = path.relative_to(ROOT).as_posix()
    if rel in table:
        return table[rel]
    folders = [p for p in table if p.endswith("/") and rel.startswith(p)]
    return table[max(folders, key=len)] if folders else None


def upward_imports(graph, modules, table) -> list[str]:
    problems = []
    for name, targets in with_parent_packages(graph).items():
        here = layer_of(modules[name], table)
        for target, line in targets:
            there = layer_of(modules[target], table) if target in modules else None
            if there is not None and here is not None and there < here:
                problems.append(f"{modules[name].relative_to(ROOT)}:{line} (layer {here}) "
                                f"imports {target} (layer {there})")
    return problems


def import_loops(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), on the imports as
    written: a package __init__ re-exporting its own modules is not a loop."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph.get(node, []):
            if target not in graph or target == node:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def test_every_module_has_a_layer():
    table = layer_table()
    missing = [str(p.relative_to(ROOT)) for p in package_modules().values()
               if layer_of(p, table) is None]
    assert not missing, f"add these to the layer table of {TABLE_PAGE.name}: {missing}"
    stale = [p for p in table if not (ROOT / p).exists()]
    assert not stale, f"the layer table names paths that do not exist: {stale}"


def test_imports_point_down_and_never_loop():
    modules = package_modules()
    graph = import_graph(modules)
    assert sum(len(t) for t in graph.values()) > 200  # the parser sees the real imports
    assert upward_imports(graph, modules, layer_table()) == []
    assert import_loops(graph) == []


@pytest.mark.parametrize("module, line, expected", [
    # module-level, upward: a leaf reaching the run
    ("megalite.config", "from megalite.training import pretrain",
     "megalite/config/__init__.py:{n} (layer 7) imports megalite.training (layer 1)"),
    # function-level, upward: the model reaching the step
    ("megalite.model.gpt", "def f():\n    from megalite import train_step",
     "megalite/model/gpt.py:{n} (layer 5) imports megalite.train_step (layer 4)"),
    # through a package whose __init__ imports: context_parallel's __init__ is layer 6
    ("megalite.parallel_state", "import megalite.context_parallel.blocks",
     "megalite/parallel_state.py:{n} (layer 7) imports megalite.context_parallel (layer 6)"),
])
def test_an_upward_import_is_found(module, line, expected):
    modules = package_modules()
    n = len(modules[module].read_text().splitlines()) + 2 + line.count("\n")  # its last line
    graph = import_graph(modules, extra={module: line})
    assert expected.format(n=n) in upward_imports(graph, modules, layer_table())


def test_a_loop_in_one_layer_is_found():
    modules = package_modules()
    # tensor_parallel/layers.py imports mappings.py; the planted line closes the loop.
    graph = import_graph(modules, extra={
        "megalite.tensor_parallel.mappings": "from megalite.tensor_parallel import layers"})
    assert upward_imports(graph, modules, layer_table()) == []  # same layer: allowed
    assert ["megalite.tensor_parallel.layers",
            "megalite.tensor_parallel.mappings"] in import_loops(graph)


def folder_graph(graph) -> dict[str, list[tuple[str, int]]]:
    """The import graph between megalite's folders (a top-level module is a folder of its
    own): folder -> the folders its modules import."""
    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])
    out: dict[str, list[tuple[str, int]]] = {}
    for name, targets in with_parent_packages(graph).items():
        edges = out.setdefault(folder(name), [])
        edges += [(folder(t), line) for t, line in targets if folder(t) != folder(name)]
    return out


def test_folders_point_one_way():
    graph = import_graph(package_modules())
    assert import_loops(folder_graph(graph)) == []


def test_a_loop_between_folders_is_found():
    modules = package_modules()
    # optimizer/ already imports timers.py; monitoring/ imports optimizer/: planting an
    # import of monitoring/ in optimizer/ closes a loop of folders, not of modules.
    graph = import_graph(modules, extra={
        "megalite.optimizer.optimizer": "from megalite.monitoring import memory"})
    assert import_loops(graph) == []
    assert ["megalite.monitoring", "megalite.optimizer"] in import_loops(folder_graph(graph))
