"""The engine's tree tells its architecture: no import circles among its modules, packages that say what they
hold and export it, and an engine that never imports the web app's libraries."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine.decoding", "engine.models", "engine.backends", "engine.measure", "engine.forge")


def modules(package: str = "engine") -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module an engine module imports, wherever the import stands (inside functions and TYPE_CHECKING
    blocks too: an import put off to a function is a circle all the same)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def graph(package: str = "engine") -> dict[str, set[str]]:
    mods = modules(package)
    return {name: {m for m in imports(path) if m in mods and m != name} for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_among_the_engines_modules():
    assert circles(graph()) == []


def test_no_import_circles_among_the_apps_modules():
    """The web app's modules too, imports inside functions included: app/layout.py built the Lab, the Lab built the
    Forge panel, and both reached back into app/layout.py for a helper from inside their functions."""
    edges = graph("app")
    assert edges["app.lab"] and edges["app.layout"]  # the graph sees the app's own imports
    assert circles(edges) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_package_says_what_it_holds_and_exports_what_others_use():
    for name in PACKAGES:
        package = importlib.import_module(name)
        assert package.__doc__ and len(package.__doc__.splitlines()) >= 3, name
        for module in (p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__"):
            assert module in package.__doc__, f"{name}'s docstring does not say what {module} is"
        for export in getattr(package, "__all__", []):
            assert getattr(package, export) is not None, (name, export)


def test_the_dependencies_point_down():
    """A comparison goes from compare down to the loop without climbing back: decoding needs no backend, model
    loading or measurement; models need no backend or measurement; backends need no measurement."""
    edges = graph()
    rules = {"engine.decoding": ("engine.backends", "engine.models", "engine.measure", "engine.compare"),
             "engine.models": ("engine.backends", "engine.measure", "engine.compare"),
             "engine.backends": ("engine.measure", "engine.compare")}  # fmt: skip
    for module, targets in edges.items():
        for package, forbidden in rules.items():
            if module.startswith(package + ".") or module == package:
                bad = [t for t in targets if t.startswith(forbidden)]
                assert not bad, f"{module} imports {bad}"


def test_the_forge_uses_the_engine_and_nothing_in_the_engine_uses_the_forge():
    edges = graph()
    users = sorted(m for m, targets in edges.items() if not m.startswith("engine.forge") and m != "engine.__main__"
                   and any(t.startswith("engine.forge") for t in targets))  # fmt: skip
    assert users == []


def test_importing_one_module_loads_neither_its_package_nor_the_web_app():
    code = ("import sys, engine.settings, engine.decoding.sampling; "
            "print(sorted(m for m in sys.modules if m.startswith(('engine.', 'gradio'))))")  # fmt: skip
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "engine.decoding.baseline" not in loaded and "engine.backends" not in loaded and "gradio" not in loaded
    for path in modules().values():
        assert not any(m.split(".")[0] in ("gradio", "plotly") for m in imports(path)), path
