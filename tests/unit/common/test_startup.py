"""run_service: the objects made by the imports are frozen out of the collector's full passes."""

import gc

import pytest

from services.common.startup import run_service

pytestmark = pytest.mark.timeout(30)


def test_a_service_starts_with_what_its_imports_made_frozen():
    seen = []

    async def main() -> None:
        seen.append(gc.get_freeze_count())

    try:
        run_service(main())
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 10_000  # torch, grpc and the rest (pytest's own process: more still)
