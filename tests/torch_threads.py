"""One torch thread in the test process, in every test module (autouse from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> None:
    """This process's own engines (the tests' references, the unit tests' models) run on one thread, as the
    service processes they start do (--num-threads 1). With two, OpenMP's threads spin waiting for each other
    whenever another process holds a core: a 1000-token reference took 164-178 s, against 10-20 s on one
    thread, at load 11 on the 2-core VM (test_migration hit its 180 s timeout there, run alone). The unit tests
    of the model against transformers ran 6x slower on two threads with two busy loops beside them (24 of
    test_model.py's 36 greedy cases in 70 s, against all 36 in 17 s on one), and no faster on an idle VM.
    Module-scoped and autouse, so it is set before the module's own fixtures compute anything."""
    torch.set_num_threads(1)
