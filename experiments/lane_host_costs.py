"""Host-side costs of one served DFlash step's messages, piece by piece (no model, no GPU).

Times, per call, what the verifier and the drafter do around a step's draft on the same-host
lane: the verifier's batch build (one entry, ring reference, history token, trace context
absent), serialize, the drafter's parse + entry decode, the tree reply's build + serialize,
and the verifier's parse + tree conversion. One-off diagnostic for issue 23 (what the lane
leaves of the round trip once the drafter's own forward is taken out).

    .venv/bin/python experiments/lane_host_costs.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from services.common.ring import ContextRing
from services.drafter import convert as dconv
from services.drafter.core import DraftTimes
from services.verifier import convert as vconv
from specserve.drafters.base import DraftRequest
from specserve.spec.tree import DraftTree


def timed(fn, n=5000) -> float:
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ring = ContextRing(1024, 2 * 256, torch.float32, "cpu")
    rings = {ring.generation: ring.view}
    req = DraftRequest("req-123", 17, 1000, 15, 40)
    rows = torch.randn(3, 512)
    tree = DraftTree(np.arange(15, dtype=np.int64), np.arange(15, dtype=np.int32),
                     np.arange(1, 16, dtype=np.int32))

    def build():
        b = vconv.draft_batch(7)
        e = vconv.add_draft_entry(b, req, "dflash", None, [17])
        s = ring.alloc(3, 7)
        ring.write(s, rows)
        vconv.set_context_ref(e, ring.generation, s, 3)
        ring.done(7)
        return b.SerializeToString()

    data = build()

    def drafter_in():
        b = dconv.batch_from_bytes(data)
        return [dconv.entry_from_pb(m, torch.device("cpu"), torch.float32, rings)
                for m in b.entries], b

    _, batch = drafter_in()

    def drafter_out():
        return dconv.tree_batch_to_pb(batch, [tree], DraftTimes()).SerializeToString()

    reply = drafter_out()

    def verifier_in():
        return vconv.trees_from_pb(vconv.tree_batch_from_bytes(reply))

    for name, fn in [("verifier build + serialize", build), ("drafter parse + decode",
                     drafter_in), ("drafter reply build + serialize", drafter_out),
                     ("verifier parse + trees", verifier_in)]:
        print(f"{name:34s} {timed(fn):7.1f} us")
    ring.close()


if __name__ == "__main__":
    main()
