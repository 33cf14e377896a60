"""The repository's layout: the design card's top level, the library below the application, and no import circle
among the modules of ``hf_posenc/`` and ``recipes/`` (type-only and function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT


PACKAGES = {"hf_posenc": ROOT / "hf_posenc", "hf_posenc_recipes": ROOT / "recipes"}
"""Each import name and the folder it is installed from (``pyproject.toml``'s ``package-dir``)."""


def module_files() -> dict[str, Path]:
    """Every module of the two packages by its dotted name (a package's ``__init__`` by the package's)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the two packages that ``name`` imports anywhere in its file: ``from package import module``
    is an arrow to the module, ``from module import name`` to the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module or "") if part)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
    return {target for target in targets if target in modules and target != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert graph["hf_posenc_recipes.long_context"] >= {"hf_posenc_recipes.reporting", "hf_posenc_recipes.pretrain"}
    assert "hf_posenc.position_interface" in graph["hf_posenc.attention_backends"]  # the reading sees arrows
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_library_never_imports_the_application():
    graph = import_graph()
    library = [name for name in graph if name.split(".")[0] == "hf_posenc"]
    assert [(name, sorted(graph[name])) for name in library if any("recipes" in t for t in graph[name])] == []


def test_the_top_level_is_the_design_cards():
    """``pyproject.toml``, ``hf_posenc``, ``recipes``, ``tests``, ``notebooks``, ``README.md``, plus ``docs``,
    ``benchmarks`` and ``.ci``; each recipe of the command is a file in ``recipes/``."""
    from hf_posenc_recipes.registry import RECIPES

    card = {"pyproject.toml", "hf_posenc", "recipes", "tests", "notebooks", "README.md", "docs", "benchmarks", ".ci"}
    assert all((ROOT / entry).exists() for entry in card)
    assert not (ROOT / "hf_posenc_cli").exists()
    assert all((ROOT / "recipes" / f"{name}.py").is_file() for name in RECIPES)
