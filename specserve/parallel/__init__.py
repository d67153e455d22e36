"""Tensor parallelism of the target model: `shard` (weights per rank), `comm` (the process
group and its collectives), `workers` (rank 0 drives ranks 1..N−1). `ModelRunner` uses them when
`EngineConfig.tensor_parallel > 1`; `start_workers` / `stop_workers` are the verifier's hooks."""

from specserve.parallel.comm import TPGroup
from specserve.parallel.shard import plan_for, shard_model
from specserve.parallel.workers import start_workers, stop_workers

__all__ = ["TPGroup", "plan_for", "shard_model", "start_workers", "stop_workers"]
