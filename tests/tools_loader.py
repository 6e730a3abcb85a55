"""Load a script of this checkout's ``tools/`` folder as a module (``tools`` is not an installed package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """``tools/<name>.py`` as a module named ``elx_tools_<name>``."""
    spec = importlib.util.spec_from_file_location(f"elx_tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
