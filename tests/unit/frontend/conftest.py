"""Fixtures of the frontend's unit tests."""

from __future__ import annotations

import pytest

from tests.unit.frontend.grammar_matching import GrammarMatching


@pytest.fixture(scope="module")
def matching(tiny_model_dir) -> GrammarMatching:
    """Texts run through a grammar token by token (grammar_matching.py)."""
    return GrammarMatching.of_test_models(tiny_model_dir)
