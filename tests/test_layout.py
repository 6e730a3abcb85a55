"""The layout and the namespace (issues 26 item 4, 27 item 5): one top-level name ``elx``, a folder per axis, no
import circles.

The repository keeps ``exporter/`` and ``runners/`` beside ``elx/``; installed, they are ``elx.exporter`` and
``elx.runners`` (pyproject's package-dir).  Every module imports them by those names, so one module is never
loaded twice under two names.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = {"elx": "elx", "exporter": "elx.exporter", "runners": "elx.runners"}
SOURCES = ("elx", "exporter", "runners", "tests", "tools")


def _modules() -> dict[str, Path]:
    """Every module of the package, by its installed dotted name."""
    found = {}
    for folder, dotted in TOPS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((dotted, *parts))] = path
    return found


def _imports(path: Path):
    """(dotted name, line) of every absolute import in ``path``, at any depth (lazy imports count)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level:
            yield "." * node.level + (node.module or ""), node.lineno


def test_every_package_folder_is_installed():
    """A folder with an ``__init__.py`` that pyproject does not list would be missing from a wheel (as
    ``runners/processors`` once was)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders == listed


# ``exporter/``'s own top level: the orchestration of an export and what every axis shares; every other module
# lives in its axis' folder (issue 41 item 4), so a new flat module fails here and must pick its folder
EXPORTER_TOP = {"__init__", "__main__", "export", "atomic", "memory", "progress", "cache_root"}
EXPORTER_AXES = {"bench", "capture", "ct2", "families", "gguf", "passes", "plugins", "precision", "presets",
                 "source", "tensorrt", "tokenizer", "verification"}


def test_exporter_is_a_folder_per_axis():
    assert {p.stem for p in (ROOT / "exporter").glob("*.py")} == EXPORTER_TOP
    assert {p.parent.name for p in (ROOT / "exporter").glob("*/__init__.py")} == EXPORTER_AXES
    assert not [p for p in (ROOT / "exporter").iterdir() if p.is_dir() and p.name not in EXPORTER_AXES
                and p.name != "__pycache__"]


def test_axis_packages_import_nothing():
    """An axis' ``__init__.py`` says what the axis is and imports none of its modules, so importing one module of
    a folder loads no other (``families``, ``source/locate.py`` stay light for the command line) and no import
    circle runs through a package; ``passes`` is the exception: its ``__init__`` is the light pass registry."""
    heavy = []
    for axis in sorted(EXPORTER_AXES - {"passes"}):
        tree = ast.parse((ROOT / "exporter" / axis / "__init__.py").read_text())
        heavy += [f"exporter/{axis}/__init__.py:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__"]
    assert not heavy, heavy


def test_sources_import_elx_names_only():
    """No module, test or tool imports ``exporter``/``runners`` as top-level packages, or relatively."""
    wrong = []
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for name, line in _imports(path):
                if name.startswith(".") or name.split(".")[0] in ("exporter", "runners"):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "\n".join(wrong)


def _circles(graph: dict[str, set]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No two modules import each other, directly or around a circle, counting lazy (in-function) imports; a
    module importing its own package (``import elx`` inside ``elx.runners``) is not a circle."""
    modules = _modules()
    graph = {name: {target for target, _ in _imports(path)
                    if target in modules and target != name and not name.startswith(target + ".")}
             for name, path in modules.items()}
    assert _circles(graph) == []


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_top_level_name_imports_cleanly():
    """Importing every module by its ``elx.`` name loads no top-level ``exporter`` or ``runners``."""
    code = ("import importlib, sys\n"
            f"for name in {sorted(n for n in _modules() if not n.endswith('__main__'))!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'exporter', 'runners'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_wheel_holds_elx_only(tmp_path):
    """The wheel's top-level names are ``elx`` and its metadata; the axes' folders and the presets are inside."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "No module named" in done.stderr:
        pytest.skip(f"cannot build a wheel here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("elx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"elx"}
    for expected in ("elx/runners/search/processors/bias.py", "elx/runners/backends/ort_io.py",
                     "elx/exporter/passes/el.py", "elx/exporter/tensorrt/build.py"):
        assert expected in names
    assert any(n.startswith("elx/exporter/presets/") and n.endswith(".json") for n in names)


def test_shell_scripts_import_what_exists():
    """The Python embedded in tools/*.sh (the README's quickstart among them) imports names that exist: a module
    move must not break the first command a user runs."""
    import importlib
    import re

    found = 0
    for script in sorted((ROOT / "tools").glob("*.sh")):
        for module, names in re.findall(r"^\s*from ([\w.]+) import ([\w, ]+)$", script.read_text(), re.M):
            if module.split(".")[0] not in ("elx", "exporter", "runners"):
                continue
            found += 1
            loaded = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(loaded, name), f"{script.name}: {module} has no {name}"
    assert found >= 2  # quickstart.sh's own imports
