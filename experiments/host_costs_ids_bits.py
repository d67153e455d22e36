"""Host costs that grow with a prompt, timed on this machine's CPU (no model, no GPU).

- A request's token ids: the gateway's `request_from_pb` + `Tokenizer.check_ids` (on its event
  loop), the verifier's id list, and `Engine.add_request`'s own check (on the engine thread,
  between every other request's steps), for 1k and 128k ids.
- A mixed step's causal bits: `attention.base.causal_bits` (one table, closed form; first call
  and then a view) beside the dense lower triangle + packbits it replaced.
One-off diagnostic for issue 23 (BENCHMARKS.md, "Where a burst's arrival spreads").

    .venv/bin/python experiments/host_costs_ids_bits.py
"""

from __future__ import annotations

import random
import time

import numpy as np

from services.gateway import convert as gconv
from specserve.attention import base
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams

TARGET = "checkpoints/demo-target"


def ms(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def dense_bits(n: int) -> np.ndarray:  # [n, W] uint32: the code before 597a19c
    width = (n + 31) // 32
    dense = np.tril(np.ones((n, width * 32), dtype=bool))
    return np.packbits(dense.reshape(n, width, 32)[:, :, ::-1], axis=-1).view(">u4").astype(
        np.uint32).reshape(n, width)


def ids_costs(tok: Tokenizer) -> None:
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    engine = Engine(EngineConfig(TARGET, kv_memory_bytes=1 << 31))
    rng = random.Random(0)
    for n in (1000, 131072):
        ids = [rng.randrange(tok.vocab_size) for _ in range(n)]
        print(f"{n:>7} ids: " + ", ".join(f"{k} {v:.3f} ms"
                                         for k, v in ids_row(tok, engine, ids).items()))


def ids_row(tok: Tokenizer, engine, ids: list[int]) -> dict:
    pb = gconv.generate_request_to_pb(ids, SamplingParams(max_tokens=4), "dflash", 15)
    req = gconv.request_from_pb(pb)
    vpb = gconv.verify_request_to_pb(req, ids)
    reps = 200 if len(ids) < 10_000 else 5

    def add():
        engine.add_request("r", ids, SamplingParams(max_tokens=4))
        engine.abort("r")

    return {"gateway request_from_pb": ms(lambda: gconv.request_from_pb(pb), reps),
            "check_ids": ms(lambda: tok.check_ids(req.token_ids), reps),
            "verifier id list": ms(lambda: list(vpb.prompt_ids), reps),
            "Engine.add_request": ms(add, reps)}


def bits_costs() -> None:
    for n in (2048, 4096, 8192):
        base._CAUSAL["bits"] = np.zeros((0, 0), np.uint32)
        t0 = time.perf_counter()
        bits = base.causal_bits(n)
        first = (time.perf_counter() - t0) * 1e3
        assert (bits == dense_bits(n)).all()
        print(f"causal bits {n:>5} rows: dense {ms(lambda n=n: dense_bits(n), 3):.1f} ms, "
              f"table {first:.1f} ms first, {ms(lambda n=n: base.causal_bits(n), 100):.4f} ms "
              "after")


def main() -> None:
    ids_costs(Tokenizer.from_dir(TARGET))
    bits_costs()


if __name__ == "__main__":
    main()
