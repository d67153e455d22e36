"""Rank 0 and its workers: rank 0 (the verifier's process, which serves gRPC and runs the
engine) drives ranks 1..N−1, each a spawned process that holds its shard of every model rank 0
builds and runs the same forwards.

Per message rank 0 broadcasts one pickled tuple over the control group (gloo), then every rank
does the same local work and meets in the forward's collectives:

    ("build", id, cls, EngineConfig)            build runner `id`'s shard: `cls(config, tp=...)`
    ("forward", id, inputs, logit_rows, taps)   `ModelRunner.forward`'s host inputs
    ("copy", id, src, dst)                      `KVPool.copy_slots` (KV compaction)
    ("stop",)                                   leave the loop and the group

Each message carries the ids of runners rank 0 dropped since the last one (their shards go).

Entry points: `start_workers(world, device)` (idempotent; `ModelRunner` calls it when
`EngineConfig.tensor_parallel > 1`), `stop_workers()` (also at exit).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

from specserve.parallel.comm import TPGroup, free_tcp_init_method, init_group, rank_device

log = logging.getLogger(__name__)


class _Leader:
    """Rank 0's side: the group, the worker processes and the runner ids."""

    def __init__(self, tp: TPGroup, procs: list, device: str) -> None:
        self.tp, self.procs, self.device = tp, procs, device
        self.ids = itertools.count()
        self.dropped: list[int] = []  # runners gone since the last message (finalizers)

    def send(self, *msg) -> None:
        dropped, self.dropped = self.dropped, []
        self.tp.broadcast((dropped, msg))


_leader: _Leader | None = None


def start_workers(world: int, device: str = "cpu", *, timeout_s: float = 600.0,
                  num_threads: int | None = None) -> TPGroup:
    """Make this process rank 0 of a `world`-rank tensor-parallel group: spawn ranks 1..world−1
    (each runs `_worker_main`) and join the default process group with them (gloo on the CPU,
    NCCL on CUDA: rank r on cuda:(k + r) for device cuda:k). Returns rank 0's `TPGroup`; a
    second call with the same world and device returns the running one (ValueError if they
    differ). `timeout_s` bounds every collective; worker threads default to this process's."""
    global _leader
    if _leader is not None:
        if (_leader.tp.world, _leader.device) != (world, str(device)):
            raise ValueError(f"tensor-parallel workers already run for world "
                             f"{_leader.tp.world} on {_leader.device}")
        return _leader.tp
    if world < 2:
        raise ValueError(f"start_workers needs world >= 2, got {world}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    init = free_tcp_init_method()
    threads = num_threads or torch.get_num_threads()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, name=f"specserve-tp{r}", daemon=True,
                         args=(r, world, init, str(device), timeout_s, threads))
             for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        tp = init_group(0, world, init, str(device), timeout_s)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    _leader = _Leader(tp, procs, str(device))
    return tp


def stop_workers(timeout_s: float = 30.0) -> None:
    """Tell the workers to stop, wait for them and leave the process group (no-op if none)."""
    global _leader
    leader, _leader = _leader, None
    if leader is None:
        return
    try:
        leader.send("stop")
    finally:
        for p in leader.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()


atexit.register(stop_workers)


def leader() -> _Leader:
    if _leader is None:
        raise RuntimeError("no tensor-parallel workers: call start_workers first")
    return _leader


def register(cls, config) -> int:
    """Rank 0: a new runner's id; the workers start building their shards of it now, as
    `cls(config, tp=group)` (`cls` is the runner's class: this package never imports it)."""
    lead = leader()
    rid = next(lead.ids)
    lead.send("build", rid, cls, config)
    return rid


def release(rid: int) -> None:
    """Rank 0: runner `rid` is gone (sent with the next message; safe from a finalizer)."""
    if _leader is not None:
        _leader.dropped.append(rid)


def _mirror(runner, msg) -> None:
    """Run rank 0's forward / copy here. An input that raises (a bad token id, a page outside
    the pool) raises on rank 0 at the same point, before any collective — the engine then
    retries without the offending request (engine.isolation): this rank goes on too."""
    try:
        if msg[0] == "forward":
            runner.run_local(*msg[2:])
        else:
            runner.kv.copy_slots(*msg[2:])
    except Exception:
        log.warning("tensor-parallel worker: %s raised (as on rank 0)", msg[0], exc_info=True)


def _worker_main(rank: int, world: int, init: str, device: str, timeout_s: float,
                 threads: int) -> None:
    torch.set_num_threads(threads)
    tp = init_group(rank, world, init, device, timeout_s)
    runners: dict = {}  # id -> its ModelRunner shard
    try:
        while True:
            dropped, msg = tp.broadcast()
            for rid in dropped:
                runners.pop(rid, None)
            op = msg[0]
            if op == "stop":
                break
            if op == "build":
                _, rid, cls, config = msg
                runners[rid] = cls(config.with_(device=rank_device(device, rank)), tp=tp)
            elif op in ("forward", "copy"):
                _mirror(runners[msg[1]], msg)
            else:
                raise RuntimeError(f"tensor-parallel worker: unknown message {op!r}")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other ranks' collectives fail on the closed connection
    dist.destroy_process_group()
