"""bench/bench_e2e.py helpers: shapes, random models built on the device, this run's ceilings,
timing, floors, and the `Bench` state (deadlines, progress log, JSON saved after every row).
Benchmark-only code."""

from __future__ import annotations

import gc
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from specserve.kvcache.pool import KVShape
from specserve.models.config import ModelConfig, RopeConfig
from specserve.models.decoder import DecoderModel
from specserve.models.dflash import DFlashDraftModel
from specserve.models.dflash_config import DFlashConfig, build_target_layer_ids
from specserve.models.rope import Rotary

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=32)
QWEN3_MASK_TOKEN = 151669  # the z-lab Qwen3 DFlash drafters' mask token id
BLOCK_SIZE = 16
ROPE_THETA = 1e6
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def target_config(shape: dict) -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", **shape, rms_norm_eps=1e-6,
                       max_position_embeddings=262144, tie_word_embeddings=False, qk_norm=True,
                       attention_bias=False, rope=RopeConfig(theta=ROPE_THETA))


def draft_config(t: ModelConfig, layers: int) -> DFlashConfig:
    return DFlashConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_layers=layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps, block_size=BLOCK_SIZE,
        target_layer_ids=build_target_layer_ids(t.num_layers, layers),
        mask_token_id=min(QWEN3_MASK_TOKEN, t.vocab_size - 1),
        layer_types=("full_attention",) * layers, causal=(False,) * layers,
        num_target_layers=t.num_layers, rope=RopeConfig(theta=ROPE_THETA))


def _random_fill(model, device, dtype, std, gen, shared=None) -> None:
    """Give a meta-device model real tensors: N(0, std) weights, ones for norms (no host copy)."""
    tensors = {}
    for name, p in model.named_parameters():
        if shared and name in shared:
            tensors[name] = shared[name]
            continue
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=gen)
        tensors[name] = t
    model.load_state_dict(tensors, strict=True, assign=True)


def build_models(shape: dict, draft_layers: int, device, dtype, std: float = 0.02, seed: int = 0):
    """Random target (`DecoderModel`) and DFlash drafter built directly on `device`; the drafter
    shares the target's embedding and LM head tensors."""
    cfg = target_config(shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        target = DecoderModel(cfg)
        drafter = DFlashDraftModel(draft_config(cfg, draft_layers))
    _random_fill(target, device, dtype, std, gen)
    target.rotary = Rotary(cfg.rope, cfg.head_dim)
    shared = {"embed.weight": target.model.embed_tokens.weight, "lm_head.weight":
              target.lm_head.weight}
    _random_fill(drafter, device, dtype, std, gen, shared)
    drafter.rotary = Rotary(drafter.config.rope, cfg.head_dim)
    target = target.to(device).eval()
    target.fuse_projections()  # as ModelRunner does: q/k/v and gate/up as one GEMM each
    return target, drafter.to(device).eval()


def param_counts(target: DecoderModel) -> dict:
    total = sum(p.numel() for p in target.parameters())
    embed = target.model.embed_tokens.weight.numel()
    head = target.lm_head.weight.numel() if target.lm_head.weight is not (
        target.model.embed_tokens.weight) else 0
    return dict(total=total, embed=embed, head=head, layers=total - embed - head)


def kv_shape(target: DecoderModel, dtype) -> KVShape:
    c = target.config
    return KVShape(c.num_layers, c.num_kv_heads, c.head_dim, dtype)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, reps: int, warmup: int, device) -> list[float]:
    """Milliseconds of each of `reps` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def p90(xs) -> float:
    """The 90th percentile (the lower of the two samples around it; nan for none)."""
    return float(sorted(xs)[int(0.9 * (len(xs) - 1))]) if xs else float("nan")


def ceilings(device, tiny: bool) -> dict:
    """This run's copy bandwidth (D2D, bytes read + written) and matmul rate (8192³, bf16)."""
    cuda = torch.device(device).type == "cuda"
    n = (1 << 30) if cuda and not tiny else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_ms = median(time_ms(lambda: y.copy_(x), 20, 3, device))
    m = 8192 if cuda and not tiny else 512
    dt = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(m, m, device=device, dtype=dt)
    mm_ms = median(time_ms(lambda: a @ a, 20, 3, device))
    return dict(copy_GBps=2 * n / (copy_ms * 1e-3) / 1e9, copy_bytes=2 * n,
                matmul_TFLOPs=2 * m**3 / (mm_ms * 1e-3) / 1e12, matmul_n=m, matmul_dtype=str(dt))


def prompt_ids(vocab: int, n: int, seed: int = 1) -> list[int]:
    """The same random prompt for ours and the peers."""
    return np.random.default_rng(seed + n).integers(0, vocab, n).tolist()


class Bench:
    """Run-wide state: device, models, ceilings, results, deadlines and the JSON file."""

    def __init__(self, args, t0: float | None = None) -> None:
        self.args, self.t0 = args, t0 or time.time()
        self.section_end = float("inf")  # elapsed seconds at which the current section stops
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        self.results: dict = {"meta": {}, "ceilings": {}}
        self.lock = threading.Lock()
        self.target = self.drafter = None
        self.counts: dict = {}
        self.ceil: dict = {}

    # ---- time and progress -------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.time() - self.t0

    def time_left(self) -> float:
        """Seconds until the run's budget or the current section's cap, whichever is first."""
        return min(self.args.budget_s, self.section_end) - self.elapsed()

    def out_of_time(self, need_s: float = 0.0) -> bool:
        return self.time_left() < need_s

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    # ---- memory ------------------------------------------------------------------------------
    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def free_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        return 8 << 30

    def mem_note(self) -> str:
        if self.device.type != "cuda":
            return ""
        free, total = torch.cuda.mem_get_info(self.device)
        return f"GPU mem used {(total - free) / 2**30:.1f} / {total / 2**30:.1f} GiB"

    # ---- floors ------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        return kv_shape(self.target, self.dtype).bytes_per_token()

    def weight_bytes(self) -> int:
        return self.counts["total"] * torch.empty((), dtype=self.dtype).element_size()

    def attn_flops_per_pair(self) -> int:  # QK + PV FLOPs of one (query, key) pair, all layers
        c = self.target.config
        return 4 * c.num_layers * c.num_heads * c.head_dim

    def floor_s(self, bytes_: float, flops: float) -> tuple[float, str]:
        mem = bytes_ / (self.ceil["copy_GBps"] * 1e9)
        comp = flops / (self.ceil["matmul_TFLOPs"] * 1e12)
        return (mem, "mem") if mem >= comp else (comp, "flop")

    # ---- output ------------------------------------------------------------------------------
    def save(self) -> None:
        """Write the JSON now (atomically); called after every row so a kill loses nothing."""
        path = Path(self.args.out)
        with self.lock:
            for _ in range(3):
                try:
                    text = json.dumps(self.results, indent=1, default=str)
                    break
                except RuntimeError:  # a dict changed size under the watchdog's dump: retry
                    time.sleep(0.01)
            else:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(path)


def host_probe_us(repeats: int = 3) -> float:
    """µs of a fixed pure-Python loop, the least of `repeats`: the host's own speed. On the
    device machines it drifts by up to 1.9 × for seconds at a time, and a batch-8 step
    (host-bound) follows it (BENCHMARKS.md, "Adaptive: the device host's own speed drifts …")."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sum(i * i for i in range(20000))
        best = min(best, time.perf_counter() - t0)
    return best * 1e6
