"""Fixtures of the verifier service tests: a tiny random target and its greedy oracle."""

from __future__ import annotations

import pytest

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.types import SamplingParams
from tests.helpers import make_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("verifier-svc"), "qwen3-gqa1-tied")
    return path


@pytest.fixture(scope="module")
def expected(target):
    """Greedy output of the in-process engine (no speculation): the oracle."""
    engine, done = Engine(EngineConfig(str(target))), {}

    def greedy(prompt: list[int], n: int) -> list[int]:  # a greedy prefix is its own answer
        if len(done.get(tuple(prompt), ())) < n:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            done[tuple(prompt)] = engine.generate([prompt], params)[0]
        return done[tuple(prompt)][:n]

    return greedy
