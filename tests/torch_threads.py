"""One torch thread in the test process while a module's service processes run beside it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> None:
    """This process's own engines (the tests' references) run on one thread, as the service processes
    they start do (--num-threads 1). With two, OpenMP's threads spin waiting for each other whenever
    another process holds a core: a 1000-token reference took 164-178 s, against 10-20 s on one
    thread, at load 11 on the 2-core VM (test_migration hit its 180 s timeout there, run alone;
    in a full run the e2e references had already set one thread for every test after them).
    Module-scoped and autouse, so it is set before the module's own fixtures compute anything; not
    set back after, as those references never did (a full run's unit tests keep running on one)."""
    torch.set_num_threads(1)
