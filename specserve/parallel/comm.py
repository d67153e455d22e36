"""The tensor-parallel process group of one model: rank, world size and the three collectives
the sharded forward needs (all-reduce of a row-parallel output, all-gather of vocab-parallel
logits, and rank 0's control messages).

Tensor collectives run on the model's backend (NCCL on CUDA, gloo on the CPU); control messages
(the host inputs of each forward, KV compaction, build / stop) always go through a gloo group of
the same ranks, so they never touch the GPU stream. The process group is torch.distributed's
default one: one tensor-parallel model group per process.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


class TPGroup:
    """One rank's view of its tensor-parallel group."""

    def __init__(self, rank: int, world: int, group=None, ctrl=None) -> None:
        self.rank, self.world = rank, world
        self.group = group  # tensor collectives (None: the default group)
        self.ctrl = ctrl  # gloo group for pickled control messages (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (returns it)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.world == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj=None):
        """Rank 0 sends `obj` (picklable), every other rank returns what rank 0 sent."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: "cpu" for every rank; "cuda" / "cuda:k" → cuda:(k + r)."""
    device = str(device)
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def init_group(rank: int, world: int, init_method: str, device: str,
               timeout_s: float = 600.0) -> TPGroup:
    """Join (create) the default process group as `rank` of `world`; returns the TP group."""
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(rank_device(device, rank)))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    ctrl = dist.new_group(backend="gloo") if backend != "gloo" else None
    return TPGroup(rank, world, None, ctrl)


def free_tcp_init_method() -> str:
    """A tcp:// rendezvous on a port free right now on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"
