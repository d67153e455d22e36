"""The model runner: owns the target model, the KV pool and the attention backend.

Turns a scheduled batch (host lists, each input with its page table) into one forward: builds
the `AttnBatch`, runs the model and returns logits only for the rows that need a token, plus the
tapped features when asked. Which pages a request holds is the scheduler's (its BlockManager);
the runner sizes the pool (`num_pages`) and reads the tables it is given.

Tensor parallel (`config.tensor_parallel` = N > 1, `specserve.parallel`): this runner is rank
0's; it starts the N − 1 workers (once per process), and each of them builds the same runner on
its shard. Every rank holds its shard's weights and its own KV pool (its kv heads; the same page
count, so one page table serves all); `forward` first broadcasts its host inputs, then every
rank runs the same local forward and meets in the collectives; `kv.copy_slots` is broadcast
too. Logits and tapped features come back whole on rank 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.attention import backend_for
from specserve.attention.base import AttnBatch
from specserve.config import EngineConfig, switched_on
from specserve.engine.graphs import StepGraphs
from specserve.kvcache.pool import KVPool, KVShape, num_pages_for_budget
from specserve.models.decoder import DecoderModel
from specserve.models.loader import load_model, resolve_dtype

DEFAULT_KV_BYTES = 256 << 20


@dataclass(frozen=True, eq=False)
class ForwardInput:
    """One request's part of a forward."""

    request_id: str
    token_ids: Seq[int]  # new tokens
    positions: Seq[int] | np.ndarray  # absolute position of each new token
    ctx_len: int  # committed tokens before them (the paged prefix)
    tree_mask: np.ndarray | None = None  # [n, W] uint32 ancestor bits; None = causal
    pages: Seq[int] | np.ndarray = field(kw_only=True)  # [pages] the request's page table


class ModelRunner:
    def __init__(self, config: EngineConfig, model: DecoderModel | None = None, *,
                 tp=None) -> None:
        """`tp`: a worker's `parallel.TPGroup` (rank ≥ 1); rank 0 (tensor_parallel > 1 and no
        `tp`) starts the workers itself and loads the checkpoint on every rank (no `model`)."""
        self.config = config
        self.device = torch.device(config.device)
        self.device_name = _device_name(self.device)  # for stats and the probe's plot
        self.dtype = resolve_dtype(config.dtype)
        self.tp, self._tp_id = tp, None
        if config.tensor_parallel > 1 and tp is None:  # rank 0
            self._lead_workers(config, model)
        self.model = model or load_model(config.model_dir, self.dtype, config.device)
        if self.tp is not None:
            from specserve.parallel import shard_model

            shard_model(self.model, self.tp.rank, self.tp.world)
            self.model.tp = self.tp
        self._build_pool_and_graphs(config)

    def _lead_workers(self, config: EngineConfig, model: DecoderModel | None) -> None:
        """Rank 0: check the model splits, start the workers, have them build their shards."""
        from specserve.models.config import load_config
        from specserve.parallel import plan_for, start_workers, workers

        if model is not None:
            raise ValueError("tensor_parallel > 1 loads the checkpoint on every rank: "
                             "give model_dir, not a model")
        plan_for(load_config(config.model_dir), config.tensor_parallel)  # ValueError here
        self.tp = start_workers(config.tensor_parallel, config.device)
        self._tp_id = workers.register(type(self), config)  # workers build shards meanwhile
        weakref.finalize(self, workers.release, self._tp_id)

    def _build_pool_and_graphs(self, config: EngineConfig) -> None:
        self.model.attn_backend = backend_for(self.device)
        self.model.fuse_projections()  # q/k/v and gate/up as one GEMM each (idempotent)
        mc = self.model.config
        self.set_taps(config.tap_layers)
        local_kv = self.model.model.layers[0].self_attn.num_kv_heads  # this rank's (TP: shard)
        shape = KVShape(mc.num_layers, local_kv, mc.head_dim, self.dtype)
        num_pages = config.num_pages or num_pages_for_budget(
            shape, config.page_size, config.kv_memory_bytes or DEFAULT_KV_BYTES
        )
        graphs = switched_on(config.cuda_graphs, self.device.type)
        # with graphs, one extra page (never handed out) takes the padding's K/V writes
        self.kv = KVPool(shape, num_pages + graphs, config.page_size, self.device,
                         config.poison_kv)
        self.num_pages = num_pages  # the scheduler's BlockManager hands these out
        if self._tp_id is not None:  # rank 0: every rank's pool makes the same copies
            self.kv.on_copy = self._send_copy
        self.graphs = StepGraphs(
            self.model, self.kv, config.page_size,
            config.max_model_len or mc.max_position_embeddings, config.max_draft_tokens + 1,
            trash_page=num_pages) if graphs else None

    def step_rows(self, tree_rows: Seq[int]) -> int:
        """K/V rows every tree of a step occupies under CUDA graphs (the step's rows bucket);
        0 without graphs (each tree takes its own rows)."""
        if self.graphs is None or not tree_rows:
            return 0
        return self.graphs.padded_rows(max(tree_rows))

    def set_taps(self, layers: Seq[int]) -> None:
        """Target layers whose outputs `forward(..., taps=True)` returns (DFlash context)."""
        n = self.model.config.num_layers
        for layer in layers:
            if not 0 <= layer < n:
                raise ValueError(f"tap layer {layer} outside the model's {n} layers")
        self.tap_layers = tuple(layers)

    @torch.inference_mode()
    def forward(
        self, inputs: Seq[ForwardInput], logit_rows: Seq[int], taps: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run all inputs in one batch.

        Returns logits `[len(logit_rows), V]` float32 for the flat rows asked for, and the tapped
        features `[T, n_taps * hidden]` of every row when `taps` (else None).
        """
        tap_layers = self.tap_layers if taps else ()
        if self._tp_id is not None:  # rank 0: the workers run the same forward on their shards
            from specserve.parallel import workers

            workers.leader().send("forward", self._tp_id, list(inputs), logit_rows, tap_layers)
        return self.run_local(inputs, logit_rows, tap_layers)

    def _send_copy(self, src, dst) -> None:
        from specserve.parallel import workers

        if isinstance(src, torch.Tensor):
            src, dst = src.cpu().numpy(), dst.cpu().numpy()
        workers.leader().send("copy", self._tp_id, src, dst)

    @torch.inference_mode()
    def run_local(self, inputs: Seq[ForwardInput], logit_rows: Seq[int],
                  tap_layers: Seq[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` on this rank alone (a worker's part of rank 0's forward)."""
        if self.graphs is not None and self.graphs.fits(inputs):  # decode / verify only
            return self.graphs.run(inputs, [x.pages for x in inputs],
                                   logit_rows, tuple(tap_layers))
        masks = [x.tree_mask for x in inputs]
        any_tree = any(m is not None for m in masks)
        ids = np.concatenate([np.asarray(x.token_ids, dtype=np.int64).reshape(-1)
                              for x in inputs])
        rows = np.fromiter(logit_rows, dtype=np.int64)
        whole = len(rows) == len(ids) and bool((rows == np.arange(len(ids))).all())
        # one host-to-device copy carries the metadata, the token ids and the logit rows
        batch, extra = AttnBatch.build_with(
            q_lens=[len(x.token_ids) for x in inputs],
            ctx_lens=[x.ctx_len for x in inputs],
            page_tables=[x.pages for x in inputs],
            positions=np.concatenate([np.asarray(x.positions, dtype=np.int64) for x in inputs]),
            page_size=self.config.page_size,
            tree_masks=masks if any_tree else None,  # None entries: causal requests
            device=self.device,
            extra=(ids,) if whole else (ids, rows),
        )
        hidden, features = self.model(extra[0], batch, self.kv, tuple(tap_layers))
        if not whole:  # only the rows that need a token go through the LM head
            hidden = hidden.index_select(0, extra[1])
        return self.model.logits(hidden), features


def _device_name(device: torch.device) -> str:
    """"cuda (NVIDIA H200)", "cpu": the device type and, on CUDA, the board's name."""
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type
