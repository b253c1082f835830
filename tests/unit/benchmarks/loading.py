"""Benchmark scripts imported as modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = sorted(path for path in (ROOT / "benchmarks").glob("*.py")  # flags.py is a module they share
                 if 'if __name__ == "__main__":' in path.read_text())


def load_benchmark(script: pathlib.Path, monkeypatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
