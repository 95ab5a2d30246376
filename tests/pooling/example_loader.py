"""Import the programs under ``examples/`` (they are scripts, not a package) for the tests."""
from __future__ import annotations

import importlib.util
import os


def load_example(name: str):
    """The module ``examples/<name>.py``."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
