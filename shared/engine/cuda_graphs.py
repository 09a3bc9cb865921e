"""CUDA graphs of the decode step, one per batch size of a ladder, so the host does not set the pace.

A decode step of an 8B model is ten kernels per layer (fused) over 32 layers; launched one by one
from Python the GPU waits on the host. Each graph here captures the whole forward (embedding, every layer, final norm,
logits) for a fixed number of one-token rows, reading its inputs from static device buffers.
A step with ``n`` decode rows copies its inputs into those buffers (two host-to-device copies from
pinned staging) and replays the smallest graph with ``>= n`` rows. A step queued while the previous
one is still on the device (the engine's overlap, see ``overlap.py``) takes its token ids from that
step's sampled ids on the device, gathered by row; the host never waits for them. Staging is double
buffered, so filling it for one step never overwrites what a queued copy of the step before reads.
Padding rows read token 0 at position 0 and write their K/V into a scratch block the block manager
never hands out, with a context of one token, so they cost almost nothing and touch no sequence's
blocks. The attention grid is sized for ``max_model_len`` (the split-K decode kernel skips splits
past each row's context), so one graph serves every context length. With fp8 weights
(``--quantization fp8``, ``model/fp8.py``) sizes up to 16 run the few-row kernel, whose tiles are
timed when the model is quantized, before capture; larger ones quantize their rows and pad them to a
multiple of 16 for ``torch._scaled_mm`` inside the graph: a fixed shape per size, like every other
buffer here.

With LoRA adapters (``shared/lora``) each row's adapter slot is one more input buffer (-1: none, and
padding): the graphs capture the gathered adapter products over the slot stacks, so an adapter
written into a slot later needs no recapture.

Tensor parallelism (``shared/parallel``): every rank captures the same ladder, in step (the
captures hold the layers' all-reduces). Rank 0's graphs begin by broadcasting their input buffers
to the other ranks' buffers, so a follower's replay needs only the batch size, sent as a command
just before rank 0 replays; followers compute no logits (sampling is rank 0's).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence as Seq

import torch

from tandem.shared.kvcache.attention import AttentionMetadata
from tandem.shared.lora.ops import LoraBatch

log = logging.getLogger("tandem.engine")

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Captured decode forwards; ``run`` returns float32 logits ``[n, vocab]`` for ``n`` decode rows."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, scratch_block: int, max_batch: int,
                 max_model_len: int, lora_slots=None) -> None:  # noqa: ANN001 - AdapterSlots
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.device = kv_cache.device
        self.max_model_len = max_model_len
        self.sizes = [b for b in BATCH_LADDER if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.table_width = -(-max_model_len // self.block_size)
        scratch_slot = scratch_block * self.block_size
        # Rows: input ids, positions, slots, context lengths, adapter slots. Padding: token 0,
        # position 0, scratch, 1, no adapter.
        self.padding = torch.tensor([0, 0, scratch_slot, 1, -1], dtype=torch.long)
        self.lora_slots = lora_slots
        self.inputs = self.padding[:, None].repeat(1, max_batch).to(self.device)
        self.tables = torch.full((max_batch, self.table_width), scratch_block, dtype=torch.int32, device=self.device)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        # Two sets of pinned staging used in turn, each with the event of its last copies.
        self.staging = [torch.empty((6, max_batch), dtype=torch.long).pin_memory() for _ in range(2)]
        self.table_staging = [torch.empty((max_batch, self.table_width), dtype=torch.int32).pin_memory()
                              for _ in range(2)]
        self.staged = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.source_rows = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.scratch_block = scratch_block
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.group = getattr(model, "tensor_parallel", None)  # a TensorParallelGroup: replays in step with it

    def _forward(self, size: int) -> torch.Tensor:
        if self.group is not None:  # rank 0's inputs into every rank's buffers, inside the graph
            self.group.broadcast(self.inputs)
            self.group.broadcast(self.tables[:size])
        ids, positions, slots = self.inputs[0, :size], self.inputs[1, :size], self.inputs[2, :size]
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=self.query_start[: size + 1],
            context_lens=self.inputs[3, :size].to(torch.int32), block_tables=self.tables[:size],
            max_query_len=1, max_context_len=self.max_model_len, block_size=self.block_size, num_decode_seqs=size,
        )
        if self.lora_slots is not None:
            self.lora_slots.batch = LoraBatch(token_slots=self.inputs[4, :size])
        try:
            hidden = self.model(ids, positions, self.kv_cache, meta)
        finally:
            if self.lora_slots is not None:
                self.lora_slots.batch = None
        if self.group is not None and not self.group.is_first:
            return hidden
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (smaller graphs reuse it)."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles Triton kernels, picks cuBLAS algorithms
                self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", ",".join(map(str, self.sizes)))

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_batch and bool(self.graphs)

    @torch.inference_mode()
    def run(self, token_ids: Seq[int], positions: Seq[int], block_tables: Seq[Seq[int]],
            device_tokens: tuple[torch.Tensor, Seq[int]] | None = None,
            adapter_slots: Seq[int] | None = None) -> torch.Tensor:
        """Replay for one-token rows: row ``i`` computes ``token_ids[i]`` at ``positions[i]`` through
        ``block_tables[i]`` (which covers that position). With ``device_tokens = (ids, rows)`` the
        first ``len(rows)`` rows take ``ids[rows[i]]`` instead, read on the device when the replay
        runs. ``adapter_slots``: each row's LoRA slot (-1 or None: none)."""
        n = len(positions)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        turn, self.turn = self.turn, 1 - self.turn
        self.staged[turn].synchronize()  # the copies that last read this set are done
        stage = self.staging[turn][:, :size]
        stage[:5].copy_(self.padding[:, None].expand(5, size))
        stage[0, :n] = torch.as_tensor(token_ids, dtype=torch.long)
        if adapter_slots is not None:
            stage[4, :n] = torch.as_tensor(adapter_slots, dtype=torch.long)
        fed = len(device_tokens[1]) if device_tokens is not None else 0
        if fed:
            stage[5, :fed] = torch.as_tensor(device_tokens[1], dtype=torch.long)
        pos = torch.as_tensor(positions, dtype=torch.long)
        stage[1, :n] = pos
        flat = [table[p // bs] for table, p in zip(block_tables, positions)]
        stage[2, :n] = torch.as_tensor(flat, dtype=torch.long) * bs + pos % bs
        stage[3, :n] = pos + 1
        # Only the columns some row uses: the kernels never read a table past its context, so the
        # stale columns to the right are harmless. Rows are packed with array slices (C speed).
        width = max(len(table) for table in block_tables)
        rows = array("i", [self.scratch_block]) * (size * width)
        for row, table in enumerate(block_tables):
            rows[row * width : row * width + len(table)] = array("i", table)
        packed = self.table_staging[turn].view(-1)[: size * width]
        packed.copy_(torch.frombuffer(rows, dtype=torch.int32))
        self.inputs[:, :size].copy_(stage[:5], non_blocking=True)
        self.tables[:size, :width].copy_(packed.view(size, width), non_blocking=True)
        if fed:
            self.source_rows[:fed].copy_(stage[5, :fed], non_blocking=True)
            torch.index_select(device_tokens[0], 0, self.source_rows[:fed], out=self.inputs[0, :fed])
        self.staged[turn].record()
        if self.group is not None:
            self.group.send_command(("replay", size))
        self.graphs[size].replay()
        return self.logits[size][:n]

    def replay_following(self, size: int) -> None:
        """A follower rank's part of rank 0's replay of the ``size`` graph (inputs come with it)."""
        self.graphs[size].replay()
