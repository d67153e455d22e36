"""The drafter contract (drafters/base.py) and the registry (drafters/registry.py): every
drafter the product ships is a `Drafter`, names resolve to builders, the engine refuses anything
else, and the drafter named by a request reaches the drafter in its DraftRequest."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specserve.drafters import registry
from specserve.drafters.base import Drafter
from specserve.drafters.ngram import NgramDrafter
from specserve.types import SamplingParams
from tests.helpers import random_prompts


class _Recording(NgramDrafter):
    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "kinds", [])

    def draft(self, requests):
        self.kinds.extend((r.request_id, r.kind) for r in requests)
        return super().draft(requests)


def test_registry_builds_by_name_and_refuses_unknown_names():
    assert registry.CHOICES == ("dflash", "ngram", "none")
    built = registry.build(registry.NGRAM, registry.DrafterSpec())
    assert isinstance(built, Drafter) and not built.needs_context and built.feed([]) is False
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        registry.build("medusa", registry.DrafterSpec())
    with pytest.raises(ValueError, match="needs its checkpoint"):
        registry.build(registry.DFLASH, registry.DrafterSpec())
    with pytest.raises(ValueError, match="must be positive, got 0, 16"):
        registry.DrafterSpec(num_pages=0)
    with pytest.raises(TypeError):  # the contract's one abstract method
        Drafter()


def test_the_contract_imports_without_torch():
    code = ("import sys, specserve.drafters.registry; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_refuses_a_non_drafter_and_passes_the_requested_kind(make_engine,
                                                                     checkpoint_cache):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    engine = make_engine(path, max_draft_tokens=7)

    class Duck:  # the old duck-typed protocol
        def draft(self, requests):
            return []

    with pytest.raises(TypeError, match="subclasses specserve.drafters.base.Drafter"):
        engine.set_drafter(Duck())
    drafter = _Recording()
    engine.set_drafter(drafter)
    prompts = random_prompts(2, hf.config.vocab_size, [11, 6], seed=3)
    for i, (prompt, kind) in enumerate(zip(prompts, ["ngram", None], strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=5, ignore_eos=True),
                           budget=7, drafter_kind=kind)
    while engine.has_unfinished:
        engine.step()
    assert {("r0", "ngram"), ("r1", None)} <= set(drafter.kinds)
    assert {k for rid, k in drafter.kinds if rid == "r0"} == {"ngram"}
