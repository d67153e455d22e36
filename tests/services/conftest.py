"""Fixtures of the verifier service tests: a tiny random target and its greedy oracle."""

from __future__ import annotations

import pytest

from tests.helpers import hf_greedy_oracle, make_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("verifier-svc"), "qwen3-gqa1-tied")
    return path


@pytest.fixture(scope="module")
def expected(target):
    """transformers' greedy output (no speculation): the oracle."""
    return hf_greedy_oracle(target)
