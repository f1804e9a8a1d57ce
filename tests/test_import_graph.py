"""The installed packages' import graph: no cycles between files, and the layering DESIGN.md sets.

The graph is built from the source with ``ast`` (nothing is imported), function-local imports
included: a local import that dodges a cycle is still a cycle. ``graphlib`` finds the cycles.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transport", "reshard", "roles", "controller", "deploy", "hybridflow")
#: package -> packages of ours it may import (DESIGN.md, "Layout")
ALLOWED = {
    "transport": {"transport"},
    "reshard": {"reshard", "transport"},
    "roles": {"roles", "reshard", "transport"},
    "controller": {"controller", "transport"},
    "deploy": set(PACKAGES) - {"hybridflow"},
    # the public facade a user's script imports: it re-exports, nothing of ours imports it
    "hybridflow": set(PACKAGES),
}


def module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def imports_of(root: Path, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports (``from pkg import mod`` resolves to the
    module when it is one; anything else to the deepest module that exists)."""
    here = module_name(root, path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != here:
                found.add(target)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules it imports. A package's ``__init__`` naming its own children is not
    an edge (re-exports are not cycles)."""
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    modules = {module_name(root, p) for p in files}
    graph = {}
    for path in files:
        name = module_name(root, path)
        deps = imports_of(root, path, modules)
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        cycle: list[str] = exc.args[1]
        return cycle
    return None


def test_no_import_cycle_between_files() -> None:
    cycle = find_cycle(import_graph(ROOT, PACKAGES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_packages_import_only_what_the_design_allows() -> None:
    wrong = [
        f"{module} imports {dep}"
        for module, deps in import_graph(ROOT, PACKAGES).items()
        for dep in deps
        if dep.split(".")[0] not in ALLOWED[module.split(".")[0]]
    ]
    assert wrong == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_local_import_is_found(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",  # a re-export: not an edge
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "def thing():\n    from . import a\n    return a\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert set(find_cycle(graph) or []) == {"pkg.a", "pkg.b"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from pkg.b import thing\n", {"pkg.b"}),
        ("from pkg import b\n", {"pkg.b"}),
        ("from . import b\n", {"pkg.b"}),
        ("from .b import thing\n", {"pkg.b"}),
        ("import pkg.b.missing\n", {"pkg.b"}),
        ("import os\nfrom pkg import nothing\n", {"pkg"}),
    ],
)
def test_imports_resolve_to_modules(tmp_path: Path, source: str, expected: set[str]) -> None:
    write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": source, "pkg/b.py": ""})
    assert imports_of(tmp_path, tmp_path / "pkg/a.py", {"pkg", "pkg.a", "pkg.b"}) == expected


def test_the_public_package_only_re_exports() -> None:
    """``hybridflow/`` holds imports, ``__all__`` and its docstring: no logic (DESIGN.md)."""
    for path in sorted((ROOT / "hybridflow").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            names = isinstance(node, ast.Assign) and [
                t.id for t in node.targets if isinstance(t, ast.Name)
            ] == ["__all__"]
            assert docstring or names or isinstance(node, ast.Import | ast.ImportFrom), (
                f"{path.relative_to(ROOT)}:{node.lineno} is not an import"
            )


def public_objects() -> list[object]:
    """What ``hybridflow`` and ``hybridflow.steps`` export: the names a user's program has."""
    import hybridflow
    import hybridflow.steps

    return [getattr(m, n) for m in (hybridflow, hybridflow.steps) for n in m.__all__]


def private_imports(path: Path) -> list[str]:
    """The framework names ``path`` imports that are not public (``public_objects``); the
    standard library and third-party packages are free."""
    import importlib

    public = public_objects()
    wrong = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wrong += [a.name for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] not in PACKAGES:
                if node.level:
                    wrong += [f"{'.' * node.level}{module}:{a.name}" for a in node.names]
                continue
            for alias in node.names:
                found = getattr(importlib.import_module(module), alias.name, None)
                if not any(found is p for p in public):
                    wrong.append(f"{module}:{alias.name}")
    return wrong


def test_the_built_in_programs_use_only_the_public_api() -> None:
    """``controller/algorithms.py`` is written as a user's program is: every name of ours it
    imports is exported by ``hybridflow`` or ``hybridflow.steps`` (a missing one is the API's
    gap, to export, not to import privately)."""
    assert private_imports(ROOT / "controller" / "algorithms.py") == []


def test_a_private_import_in_a_program_is_named(tmp_path: Path) -> None:
    program = tmp_path / "program.py"
    program.write_text(
        "import torch\n"
        "from controller import advantages\n"  # public: hybridflow.advantages
        "from controller.steps import learn, on\n"  # `on` is not exported
        "from controller.scoring import scores\n"
        "import deploy.mesh\n"
    )
    assert private_imports(program) == [
        "controller.steps:on",
        "controller.scoring:scores",
        "deploy.mesh",
    ]
