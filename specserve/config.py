"""Engine configuration: one frozen, validated dataclass.

Network settings live in the services' own configs, which *contain* an `EngineConfig`; nothing
here knows about ports or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SWITCH = ("auto", "on", "off")  # a GPU-only feature: auto = on where the work runs on CUDA
MIXED_CHUNKS = ("cost", "tokens")  # how a prefill chunk beside decoding requests is cut


def check_switch(name: str, value: str) -> None:
    check_choice(name, value, SWITCH)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def switched_on(value: str, device: str) -> bool:
    """Whether an auto / on / off `value` is on for work on `device` ("cpu", "cuda:1", …)."""
    return value == "on" or (value == "auto" and str(device).startswith("cuda"))


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; else derived from kv_memory_bytes
    kv_memory_bytes: int | None = None  # KV pool byte budget (default 256 MiB)
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # tokens per forward: decodes first, then prefill chunks
    # a prefill chunk beside decoding requests: "cost" = cut to what max_num_batched_tokens
    # tokens cost at context 0 (engine/chunk_cost.py: their step stays short at long context);
    # "tokens" = max_num_batched_tokens tokens whatever its context
    mixed_chunks: str = "cost"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    tap_layers: tuple[int, ...] = ()  # target layers whose outputs feed the drafter
    max_draft_tokens: int = 0  # largest tree budget (a request reserves its own budget's rows)
    poison_kv: bool = False  # fill the pool with NaN (tests)
    # decode / verify steps as CUDA graphs (engine/graphs.py): auto = on CUDA; "on" on the CPU
    # runs the same padded static path eagerly (its CPU twin)
    cuda_graphs: str = "auto"
    # drafting overlapped with verification: two groups of speculating requests take turns
    # (engine/overlap.py; needs a drafter that can `submit` ahead, the drafter service's client)
    overlap: bool = False
    # with a drafter that can `submit` ahead (the drafter service's client) and no overlap: the
    # next step's drafts are sent as soon as a step's acceptance is known, so the commit's
    # remaining host work runs while the drafter drafts (engine/overlap.Ahead); with adaptive,
    # while its decision to draft holds (each request asking for the tree its shape needs)
    draft_ahead: bool = True
    # adaptive speculation (engine/adaptive.py): each step's tree (or none) chosen by measured
    # cost and the drafter's probabilities, the request's budget its bound; off = as asked
    adaptive: bool = False
    max_waiting: int | None = None  # queued requests past which add_request refuses (None: ∞)
    # verifier tensor parallelism: ranks the target's weights are sharded over (this process
    # rank 0, the others spawned by specserve.parallel; gloo on the CPU, NCCL on CUDA)
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        check_switch("cuda_graphs", self.cuda_graphs)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        check_choice("mixed_chunks", self.mixed_chunks, MIXED_CHUNKS)
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.max_waiting is not None and self.max_waiting <= 0:
            raise ValueError(f"max_waiting must be positive or None, got {self.max_waiting}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be an int >= 1, got {self.tensor_parallel!r}")
        if not 0 <= self.max_draft_tokens <= 1024:
            raise ValueError(f"max_draft_tokens must be in [0, 1024], got {self.max_draft_tokens}")

    def with_(self, **changes) -> EngineConfig:
        return replace(self, **changes)
