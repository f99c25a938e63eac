"""Tiny random checkpoints of tests/model, shared with the fast-path tests."""

from tests.model.conftest import tiny_models  # noqa: F401  (session fixture)
