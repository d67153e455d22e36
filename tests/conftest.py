"""Shared fixtures: tiny random HF checkpoints (saved with transformers' save_pretrained) and an
engine factory whose engines must have 0 KV pages in use after every test."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models: intra-op threads only add hand-off latency (ms per op on a busy 2-core box).
torch.set_num_threads(1)

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import Engine  # noqa: E402
from tests.helpers import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_cache(tmp_path_factory):
    cache: dict = {}

    def get(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(name), name, **overrides)
        return cache[key]

    return get


@pytest.fixture
def make_engine():
    """Build engines; after the test every one of them must hold 0 KV pages."""
    engines: list[Engine] = []

    def make(model_dir, model=None, **cfg) -> Engine:
        cfg.setdefault("poison_kv", True)
        engine = Engine(EngineConfig(str(model_dir), **cfg), model=model)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert engine.blocks.num_used_pages == 0, "KV pages leaked"
        assert engine.blocks.num_reserved_pages == 0, "KV page reservations leaked"
