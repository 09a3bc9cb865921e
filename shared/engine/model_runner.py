"""Runs one scheduled batch through the model: owns the paged KV cache, builds the flattened
varlen inputs and attention metadata, takes the hidden row of each sampling sequence's last query
token, computes its logits, processes them (``logits_processors``) and samples; for sequences
asking for prompt logprobs it also scores their prefill chunks' prompt tokens (``prompt_logprobs``),
and for embedding sequences it pools their chunks' hidden rows (``pooling``).
Also moves whole prompt blocks in and out of the cache for prefill -> decode hand-offs, and
preempted sequences' blocks to and from the host swap space.
"""

from __future__ import annotations

import array
import gc
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tandem.shared.engine.cuda_graphs import DecodeGraphs
from tandem.shared.engine.logits_processors import process_logits
from tandem.shared.engine.pooling import PooledRows, pool_rows
from tandem.shared.engine.prompt_logprobs import PromptRows, compute_prompt_logprobs, rows_scoring_prompt
from tandem.shared.engine.sampling import SampledLogprobs, gather_logprobs, sample, sample_rows_alone
from tandem.shared.engine.scheduler_output import ScheduledBatch
from tandem.shared.kvcache.attention import AttentionMetadata, build_attention_metadata
from tandem.shared.kvcache.cache import allocate_kv_cache, gather_blocks, scatter_blocks
from tandem.shared.kvcache.swap_space import SwapSpace
from tandem.shared.kvtransfer.devcopy import host_values_to
from tandem.shared.lora.ops import LoraBatch
from tandem.shared.lora.slots import AdapterSlots
from tandem.shared.model.fp8 import quantize_model
from tandem.shared.protocol.serving import TokenLogprobs
from tandem.shared.structured.bitmask import TokenBitmask

# (compute FLOP/s, host copy bytes/s) by device type: the effective rates the preemption policy
# prices recompute and swap with (engine/preemption_cost.py); rough defaults, not measurements, that
# only need to rank recompute against swap: float32 matmul and memory-bandwidth copies on a CPU,
# bf16 tensor cores well below their peak and pinned copies over PCIe on a GPU.
DEVICE_RATES: dict[str, tuple[float, float]] = {"cpu": (300e9, 10e9), "cuda": (400e12, 25e9)}


@dataclass
class PendingStep:
    """A launched step's logits (maybe still being computed) and what sampling needs."""

    logits: torch.Tensor
    params: list  # row i's SamplingParams (a forked sample's own, with its own seed)
    output_indices: list[int]
    # Row i's sequence: its tokens so far are the row's history (penalties). A sequence appears in
    # several rows when one set of logits starts several samples (a request's first token with n > 1).
    seqs: list = field(default_factory=list)


@dataclass
class SampledTokens:
    """A step's sampled ids: ``device`` (feeds the next step's inputs without a round trip) and a
    host copy that ``wait`` returns once the device has made it."""

    device: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None
    # Rows whose own sampling raised, with what it raised: their ids are placeholders and the
    # engine ends their sequences; every other row has its token.
    failed_rows: dict[int, Exception] = field(default_factory=dict)
    # The rows that asked for logprobs, host copies made with the ids' (None: no row asked).
    logprobs: SampledLogprobs | None = None

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def wait_logprobs(self) -> list[TokenLogprobs | None] | None:
        """One entry per row (None for rows that did not ask), or None when no row asked."""
        if self.logprobs is None:
            return None
        if self.done is not None:
            self.done.synchronize()
        return self.logprobs.per_row(self.host.shape[0])


class ModelRunner:
    """The model plus its KV cache ``[num_blocks, num_layers, 2, block_size, Hkv, D]``."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        generator: torch.Generator | None = None,
        cuda_graph_max_batch: int = 0,
        max_model_len: int = 4096,
        eos_token_ids: Seq[int] = (),
        swap_space: SwapSpace | None = None,
        quantization: str = "none",
        lora_slots: AdapterSlots | None = None,
    ) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        use_graphs = self.device.type == "cuda" and cuda_graph_max_batch > 0
        if self.device.type == "cuda":
            model.fuse_projections()
        if quantization != "none":
            # After fusing (the fused codes are the one copy), before the KV pool takes the memory
            # the float weights free and before graphs capture the fp8 matmuls. A model the loader
            # already quantized is left as it is.
            quantize_model(model, quantization)
        # With graphs, one block more than the block manager knows: padding rows write there.
        self.kv_cache = allocate_kv_cache(
            num_blocks + use_graphs, config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype,
            self.device,
        )
        self.generator = generator  # for unseeded sampling rows; None = torch's default generator
        self.eos_token_ids = tuple(eos_token_ids)  # masked with a request's stop ids until its min_tokens
        self.swap_space = swap_space  # host blocks of swapped-out sequences (None: no swapping)
        self.compute_flops_per_s, self.copy_bytes_per_s = DEVICE_RATES.get(self.device.type, DEVICE_RATES["cpu"])
        self.graphs: DecodeGraphs | None = None
        self.last_logits: torch.Tensor | None = None
        self.lora_slots = lora_slots
        if lora_slots is not None:  # before capture: the graphs record the adapter products too
            model.attach_lora(lora_slots)
        if use_graphs:
            # Garbage first: pinned memory of a dead engine (its swap space) that the collector frees
            # in the middle of the capture records a CUDA event there, which invalidates the capture.
            gc.collect()
            self.graphs = DecodeGraphs(model, self.kv_cache, num_blocks, cuda_graph_max_batch, max_model_len,
                                       lora_slots)
            self.graphs.capture()

    @property
    def kv_layout(self) -> tuple[int, ...]:
        """One exported block's shape ``(L, 2, bs, Hkv, D)``: what hand-offs and KV-stores carry."""
        return tuple(self.kv_cache.shape[1:])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                adapter_rows: Seq[tuple[int, int]] = ()) -> torch.Tensor:
        """The model over one flattened batch (outside the decode graphs): final hidden rows ``[T, hidden]``.
        ``adapter_rows``: ``(adapter slot, rows)`` per sequence in batch order (slot -1: none)."""
        if self.lora_slots is None:
            return self.model(input_ids, positions, self.kv_cache, meta)
        self.lora_slots.batch = LoraBatch.from_runs(adapter_rows, input_ids.device)
        try:
            return self.model(input_ids, positions, self.kv_cache, meta)
        finally:
            self.lora_slots.batch = None

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy tensors (the model's own names and shapes) into the model in place: the decode graphs
        keep reading the same storage. Float weights of fp8 linears are quantized on the way in."""
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flattened ``input_ids``/``positions`` ``[T]`` and the metadata for one batch."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        for item in batch.items:
            seq, start = item.seq, item.seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + item.num_query_tokens])
            positions.extend(range(start, start + item.num_query_tokens))  # C-level, no Python per token
            query_lens.append(item.num_query_tokens)
            context_lens.append(start + item.num_query_tokens)
            block_tables.append(seq.block_table)
        meta = build_attention_metadata(query_lens, context_lens, block_tables, self.block_size, self.device)
        # One host->device copy for ids and positions together; an int64 array is filled in C, where
        # torch.tensor walks a prefill step's 16K Python ints one by one.
        flat = array.array("q", input_ids)
        flat.extend(positions)
        ids_and_positions = (torch.frombuffer(flat, dtype=torch.long) if flat else torch.empty(0, dtype=torch.long)
                             ).view(2, -1).to(self.device)
        return ids_and_positions[0], ids_and_positions[1], meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Run the batch; return one sampled token per item with ``samples`` set, in batch order."""
        return self.sample(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> PendingStep | None:
        """Queue the batch's forward and logits on the device without waiting for them (on CUDA the
        host is free until :meth:`sample`); None when no item samples."""
        rows: list[int] = []
        params = []
        output_indices: list[int] = []
        seqs = []
        prompt_rows: list[PromptRows] = []  # rows whose logits score prompt tokens (prompt logprobs)
        pooled: list[PooledRows] = []  # embedding sequences' rows (an embedding samples nothing: fan_out 0)
        end = 0
        for item in batch.items:
            if scoring := rows_scoring_prompt(item.seq, item.num_query_tokens):
                prompt_rows.append(PromptRows(item.seq, end, scoring))
            if item.seq.pooling is not None:
                pooled.append(PooledRows(item.seq, end, item.num_query_tokens, item.samples))
            end += item.num_query_tokens
            if item.samples:
                seq = item.seq
                # The last query token's logits; a group's prompt starts several samples from them.
                rows.extend([end - 1] * seq.fan_out)
                params.extend(seq.group.first_params() if seq.fan_out > 1 else [seq.params] * seq.fan_out)
                output_indices.extend([seq.num_output_tokens] * seq.fan_out)
                seqs.extend([seq] * seq.fan_out)
        if (end == len(batch.items) and not prompt_rows and not pooled and self.graphs is not None
                and self.graphs.can_run(end)):
            logits = self._run_decode_graph(batch)  # every row is one token: replay a graph
            if rows != list(range(end)):
                logits = logits[host_values_to(self.device, rows, torch.long)]
        else:
            input_ids, positions, meta = self.prepare(batch)
            hidden = self.forward(input_ids, positions, meta,
                                  [(item.seq.lora_slot, item.num_query_tokens) for item in batch.items])
            if prompt_rows:
                self._prompt_logprobs(hidden, prompt_rows)
            if pooled:
                pool_rows(hidden, pooled, _to_pinned if self.device.type == "cuda" else _same)
            if not rows:
                return None
            row_index = host_values_to(self.device, rows, torch.long)
            logits = self.model.compute_logits(hidden.index_select(0, row_index))
        if not rows:
            return None
        return PendingStep(logits, params, output_indices, seqs)

    @torch.inference_mode()
    def sample(self, pending: PendingStep | None) -> list[int]:
        """The sampled token ids of a launched step (waits for the device)."""
        return [] if pending is None else self.sample_async(pending).wait()

    @torch.inference_mode()
    def launch_decode(self, seqs: Seq, prev_tokens: torch.Tensor, source_rows: Seq[int]) -> PendingStep:
        """Queue one decode row per sequence. The first ``len(source_rows)`` sequences have a newest
        token still being sampled on the device: row ``i`` computes ``prev_tokens[source_rows[i]]``
        at position ``seqs[i].num_tokens`` (the index that token will have). The others compute
        their last known token (hand-offs just admitted). Block tables must cover those positions."""
        fed = len(source_rows)
        positions = [seq.num_tokens if i < fed else seq.num_computed_tokens for i, seq in enumerate(seqs)]
        known = [0 if i < fed else seq.token_ids[-1] for i, seq in enumerate(seqs)]
        tables = [seq.block_table for seq in seqs]
        adapter_slots = [seq.lora_slot for seq in seqs]
        if self.graphs is not None and self.graphs.can_run(len(seqs)):
            logits = self.graphs.run(known, positions, tables, device_tokens=(prev_tokens, source_rows),
                                     adapter_slots=adapter_slots)
        else:
            meta = build_attention_metadata([1] * len(seqs), [p + 1 for p in positions], tables, self.block_size,
                                            self.device)
            input_ids = host_values_to(self.device, known, torch.long)
            if fed:
                input_ids[:fed] = prev_tokens.index_select(0, host_values_to(self.device, source_rows, torch.long))
            hidden = self.forward(input_ids, host_values_to(self.device, positions, torch.long), meta,
                                  [(slot, 1) for slot in adapter_slots])
            logits = self.model.compute_logits(hidden)
        indices = [seq.num_output_tokens + (i < fed) for i, seq in enumerate(seqs)]
        return PendingStep(logits, [seq.params for seq in seqs], indices, list(seqs))

    @torch.inference_mode()
    def sample_async(self, pending: PendingStep, bitmask: TokenBitmask | None = None) -> SampledTokens:
        """Queue sampling of a launched step and the copy of its ids to the host; wait for neither.

        Rows are sampled from their processed logits (penalties, ``min_tokens``, ``logit_bias``: see
        ``logits_processors``; processing happens before sampling only). When sampling the batch
        raises, its rows are sampled one by one: rows that fail alone are listed in ``failed_rows``;
        when none does, the failure is the batch's and is raised. The logprobs of rows that ask are
        the raw logits', of the ids sampled on either path (a failed row's entry is of its
        placeholder id, and is dropped with its sequence). ``bitmask``: the constrained rows' token
        masks (structured outputs), applied after processing."""
        self.last_logits = pending.logits  # the raw rows, for tests and debugging
        logits = process_logits(pending.logits, pending.params, pending.seqs, pending.output_indices,
                                self.eos_token_ids)
        if bitmask is not None:  # last: no bias or penalty brings back a token the grammar leaves out
            logits = bitmask.apply(logits)
        try:
            ids, failed = sample(logits, pending.params, pending.output_indices, self.generator), {}
        except Exception:
            ids, failed = sample_rows_alone(logits, pending.params, pending.output_indices, self.generator)
            if not failed:
                raise  # every row samples alone: not one row's fault (device memory, say)
        logprobs = gather_logprobs(pending.logits, ids, pending.params)
        if ids.device.type != "cuda":
            return SampledTokens(ids, ids, None, failed, logprobs)
        host = _to_pinned(ids)
        host_logprobs = None if logprobs is None else logprobs.map(_to_pinned)
        done = torch.cuda.Event()  # recorded after every copy: one wait covers ids and logprobs
        done.record()
        return SampledTokens(ids, host, done, failed, host_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list[PromptRows]) -> None:
        """Queue the prompt logprobs of a batch's ``prompt_rows`` of ``hidden`` and their copy to the
        host; each sequence keeps its chunk (see ``prompt_logprobs``)."""
        to_host = _to_pinned if self.device.type == "cuda" else _same
        compute_prompt_logprobs(self.model.compute_logits, hidden, prompt_rows, to_host)

    def _run_decode_graph(self, batch: ScheduledBatch) -> torch.Tensor:
        seqs = [item.seq for item in batch.items]
        positions = [seq.num_computed_tokens for seq in seqs]
        token_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
        return self.graphs.run(token_ids, positions, [seq.block_table for seq in seqs],
                               adapter_slots=[seq.lora_slot for seq in seqs])

    @torch.inference_mode()
    def export_kv(self, block_table: Seq[int], num_tokens: int) -> torch.Tensor:
        """A copy of the blocks holding the first ``num_tokens`` tokens, ``[n, L, 2, bs, Hkv, D]``,
        on the cache's device: the hand-off moves it from there (GPU -> pinned ring directly)."""
        num_blocks = -(-num_tokens // self.block_size)
        return gather_blocks(self.kv_cache, list(block_table[:num_blocks]))

    @torch.inference_mode()
    def copy_blocks(self, pairs: Seq[tuple[int, int]]) -> None:
        """Copy-on-write: each ``(source, destination)`` block's K/V, every layer, queued on the
        stream before the step that writes the destinations."""
        if pairs:
            sources, destinations = zip(*pairs)
            scatter_blocks(self.kv_cache, list(destinations), gather_blocks(self.kv_cache, list(sources)))

    @torch.inference_mode()
    def import_kv(self, block_table: Seq[int], kv: torch.Tensor) -> None:
        """Write exported blocks ``kv`` into the first ``kv.shape[0]`` blocks of ``block_table``."""
        scatter_blocks(self.kv_cache, list(block_table[: kv.shape[0]]), kv)

    @torch.inference_mode()
    def swap_out(self, pairs: Seq[tuple[int, int]]) -> None:
        """Copy each ``(device block, host block)``'s K/V, every layer, into the swap space: queued
        on the current stream behind the steps that wrote them and ahead of any later write into the
        device blocks; the host does not wait (pinned memory on CUDA)."""
        for device_block, host_block, count in _runs(pairs):
            self.swap_space.kv[host_block : host_block + count].copy_(
                self.kv_cache[device_block : device_block + count], non_blocking=True)

    @torch.inference_mode()
    def swap_in(self, pairs: Seq[tuple[int, int]]) -> None:
        """Copy each ``(device block, host block)``'s K/V back from the swap space, queued on the
        current stream ahead of the steps that read them; the host does not wait."""
        for device_block, host_block, count in _runs(pairs):
            self.kv_cache[device_block : device_block + count].copy_(
                self.swap_space.kv[host_block : host_block + count], non_blocking=True)


def _runs(pairs: Seq[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(device block, host block)`` pairs as ``(first device block, first host block, count)``
    runs consecutive on both sides: one copy per run (a victim's blocks are often allocated in a row)."""
    runs: list[list[int]] = []
    for device_block, host_block in pairs:
        if runs and runs[-1][0] + runs[-1][2] == device_block and runs[-1][1] + runs[-1][2] == host_block:
            runs[-1][2] += 1
        else:
            runs.append([device_block, host_block, 1])
    return [(d, h, n) for d, h, n in runs]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy of a device tensor to pinned host memory; read it after the stream's event.

    Pinned, from torch's caching host allocator: it hands a block out again only once the copies
    recorded on it are done, so two steps in flight never share a landing place."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
