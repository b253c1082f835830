"""`python -m tests.integration.paced_steps PACE_FILE python -m services.instance ARGS...`: a real instance
process whose engine steps each take at least the milliseconds written in PACE_FILE, while that file exists.

A test paces a migration's source while the move runs: its request then cannot reach its end first, however
busy the machine (a request of 1000 tokens decodes in about 2 s on a quiet one, and a loaded one could finish
it before the move took it). Unpaced, the instance runs exactly as `python -m services.instance` does.
"""

from __future__ import annotations

import contextlib
import pathlib
import runpy
import sys
import time
from collections.abc import Callable, Iterator

from services.instance.engine.engine import LLMEngine
from services.instance.engine.step_output import StepOutput


def pace_ms(pace_file: pathlib.Path) -> float:
    try:
        return float(pace_file.read_text())
    except (FileNotFoundError, ValueError):
        return 0.0


def paced(step: Callable[[LLMEngine], list[StepOutput]], pace_file: pathlib.Path) -> Callable:
    def step_at_pace(engine: LLMEngine) -> list[StepOutput]:
        started = time.monotonic()
        outputs = step(engine)
        time.sleep(max(0.0, pace_ms(pace_file) / 1000 - (time.monotonic() - started)))
        return outputs
    return step_at_pace


@contextlib.contextmanager
def pace(pace_files: list[pathlib.Path], ms: float) -> Iterator[None]:
    """Every step of the instances that watch `pace_files` takes at least `ms` inside the block."""
    for pace_file in pace_files:
        pace_file.with_suffix(".tmp").write_text(str(ms))
        pace_file.with_suffix(".tmp").replace(pace_file)  # whole, as a step reads it
    try:
        yield
    finally:
        for pace_file in pace_files:
            pace_file.unlink(missing_ok=True)


def main() -> None:
    pace_file, _python, flag, module, *args = sys.argv[1:]
    if flag != "-m":
        raise SystemExit(f"usage: {__doc__.splitlines()[0]}")
    LLMEngine.step = paced(LLMEngine.step, pathlib.Path(pace_file))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
