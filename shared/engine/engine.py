"""``LLMEngine``: the synchronous engine core the prefill and decode services run in a worker thread.

``step()`` = schedule a batch -> queue its swaps, scatter imported KV -> run the model and sample -> postprocess
(append tokens, stop checks, free finished) -> one ``RequestOutput`` per request that got a token.
Services use an engine only as an ``EngineView`` (``engine_view.py``); its parts stay in here.

Prefill/decode hand-off: a ``prefill_only`` request finishes right after its first sampled token
with reason "prefilled" and its output carries the KV of its computed tokens (gathered before the
blocks are freed): the prompt's, and those of output tokens it came with (a migrated request's).
If that first token already ends the request (eos, stop, length) the normal reason is reported
and no KV is attached. The decode engine takes the request with ``kv`` and ``output_token_ids``
set and continues after them; its text deltas continue where the prefill worker's stopped
(held-back text is re-derived, never sent twice).

Prefix caching (``EngineConfig.enable_prefix_caching``, vLLM-style automatic prefix caching): full
blocks stay in the pool after their sequence ends, keyed by chained block hash, and a new or
re-prefilling sequence starts from the longest cached prefix of its tokens (see the scheduler).
Imported blocks are hashed right after they are scattered in, so they are cacheable too.
``drain_kv_events`` hands the services the hashes this engine started / stopped holding.

Embeddings (``EngineRequest.pooling``, see ``pooling.py``): the prompt is prefilled, in chunks and
in the same batches as generating sequences, its hidden rows pooled; nothing is sampled, and the
request ends with reason "embedded" and its vector on ``RequestOutput.embedding``. Its computed
blocks are hashed and cached for later requests like any prompt's.

Row failures: a request whose own part of a step raises (sampling its row, appending its token,
its stop checks, its text) ends alone with reason "error" and its ``RequestOutput.error``; its blocks
go back as with an abort and the rest of the batch goes on as if it had not been there. What fails
for the batch as a whole (the forward, a device out of memory) still raises from ``step``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time

import torch

from tandem.shared.engine.beam_search import BeamHypothesis, token_entry
from tandem.shared.engine.detokenizer import IncrementalDetokenizer, can_defer_text, catch_up_text
from tandem.shared.engine.engine_view import EngineStats, KVPoolView, SequenceView
from tandem.shared.engine.model_runner import ModelRunner, PendingStep, SampledTokens
from tandem.shared.engine.overlap import InFlightStep, is_pure_decode, plan_ahead
from tandem.shared.engine.pooling import FINISH_REASON as EMBEDDED
from tandem.shared.engine.pooling import Pooling
from tandem.shared.engine.preemption_cost import PreemptionCosts
from tandem.shared.engine.prompt_logprobs import PromptLogprobs
from tandem.shared.engine.scheduler import Scheduler
from tandem.shared.engine.scheduler_output import ScheduledBatch, ScheduledSequence
from tandem.shared.engine.sequence import EngineRequest, RequestOutput, Sequence, SequenceStatus, checked_params
from tandem.shared.engine.sequence_group import SequenceGroup
from tandem.shared.engine.swapping import Swapper
from tandem.shared.engine.tp_model_runner import TensorParallelRunner
from tandem.shared.infra.config import EngineSettings
from tandem.shared.kvcache.block_manager import BlockManager
from tandem.shared.kvcache.cache import kv_cache_bytes_per_block
from tandem.shared.kvcache.swap_space import SwapSpace
from tandem.shared.lora.cache import AdapterCache
from tandem.shared.lora.slots import AdapterSlots
from tandem.shared.protocol.adapters import adapter_hash_root
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.embedding import POOLING_METHODS
from tandem.shared.protocol.serving import SamplingParams, TokenLogprobs
from tandem.shared.structured.bitmask import TokenBitmask, fill_bitmask
from tandem.shared.structured.compiler import GrammarCompiler
from tandem.shared.structured.output_grammar import GrammarViolation
from tandem.shared.text.tokenizer import Tokenizer

# The engine's config is the settings' engine section: one class, so a knob added there (with its
# flag and TANDEM_ variable) reaches the engine without another edit. Fields the engine reads:
# block_size, num_blocks (>= 1 here: 0, "size from memory", is the worker's to resolve),
# max_num_seqs, max_num_batched_tokens (query tokens per step: decodes + prefill chunks),
# max_model_len (also capped by the model's RoPE table), enable_prefix_caching (off: no lookups, no
# cached blocks, no KV events), enforce_eager (CUDA: no decode graphs), async_output (detokenize a
# step's tokens while the device runs the next step; None: on for CUDA, where the forward runs
# asynchronously to the host), overlap_steps (queue the next decode step before the host has this
# one's tokens, see ``overlap.py``; None: on with CUDA graphs, off otherwise), swap_space_gib (host
# memory preempted sequences' blocks are swapped out to; 0: preemption recomputes) and
# preemption_mode (auto, swap or recompute: see the scheduler) and quantization (fp8: the runner
# quantizes the model's decoder linears, unless the loader already did). device, dtype and the
# memory budgets are the worker's: ``LLMEngine`` takes the resolved device and dtype as arguments.
# max_loras (> 0: LoRA adapter slots on the device, see shared/lora), max_lora_rank, max_cpu_loras.
EngineConfig = EngineSettings

log = logging.getLogger("tandem.engine")

# Independently compiled templates of one structured-output spec on a GPU worker: about the threads
# llguidance fills masks on (see shared/structured/compiler.py).
PARALLEL_TEMPLATES = 16
# Finish reasons whose output is made when the sequence ends, not by a step's token: no text, no KV.
ENDED_APART = ("abort", "error")
# What an embedding's sequence carries as its sampling parameters: nothing samples with them.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def constrained_kind(params: SamplingParams) -> str:
    return "" if params.structured_output is None else params.structured_output.kind


class LLMEngine:
    """Continuous-batching engine over one model and one paged KV cache. Not thread-safe."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        config: EngineConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        if config.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be >= 1, got {config.num_blocks} "
                             "(0 means sized from memory: the worker resolves it before building the engine)")
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size: int = model.config.vocab_size
        self.hidden_size: int = model.config.hidden_size  # an embedding's length
        self.max_model_len = min(config.max_model_len, model.config.max_position_embeddings)
        dtype = dtype if dtype is not None else next(model.parameters()).dtype
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        cfg = model.config
        # Adapter slots before the KV pool and the graphs: the pool is sized after them, the graphs read them.
        self.adapters: AdapterCache | None = None
        if config.max_loras > 0:
            if getattr(model, "tensor_parallel", None) is not None:
                raise ValueError("LoRA adapters are not served with --tensor-parallel-size > 1 yet; use one device "
                                 "per worker or --max-loras 0")
            slots = AdapterSlots(cfg, config.max_loras, config.max_lora_rank, device, dtype)
            self.adapters = AdapterCache(cfg, slots, config.max_cpu_loras)
        self.swap_space = SwapSpace.for_cache(config.swap_space_gib, cfg.num_layers, config.block_size,
                                              cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=tokenizer.eos_token_ids,
            on_finish=self._on_finish,
            swapper=None if self.swap_space is None else Swapper(self.block_manager, self.swap_space),
            preemption_mode=config.preemption_mode,
            adapters=self.adapters,
        )
        runner_kwargs = dict(cuda_graph_max_batch=0 if config.enforce_eager else config.max_num_seqs,
                             max_model_len=self.max_model_len, eos_token_ids=tokenizer.eos_token_ids,
                             swap_space=self.swap_space, quantization=config.quantization,
                             lora_slots=None if self.adapters is None else self.adapters.slots)
        group = getattr(model, "tensor_parallel", None)  # a shard of a model (shared/parallel/sharding.py)
        if group is None:
            self.runner = ModelRunner(model, config.num_blocks, config.block_size, device, dtype, **runner_kwargs)
        else:
            self.runner = TensorParallelRunner(model, config.num_blocks, config.block_size, device, dtype, group,
                                               **runner_kwargs)
        # "auto" preemption prices recompute against swap at the runner's rates for its device type.
        block_bytes = kv_cache_bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.preemption_costs = PreemptionCosts.for_model(cfg, block_bytes, self.runner.compute_flops_per_s,
                                                          self.runner.copy_bytes_per_s)
        self.scheduler.swap_is_cheaper = self.preemption_costs.swap_is_cheaper
        self.async_output = (config.async_output if config.async_output is not None
                             else self.runner.device.type == "cuda")
        self.overlap_steps = (config.overlap_steps if config.overlap_steps is not None
                              else self.runner.graphs is not None)
        self._in_flight: InFlightStep | None = None
        self.num_overlapped_steps = 0
        # (sequence, its newest token, that token's logprobs if asked) awaiting text
        self._text_pending: list[tuple[Sequence, int, TokenLogprobs | None]] = []
        self._arrivals = itertools.count()
        self._aborted_outputs: list[RequestOutput] = []
        self._failed_rows: list[RequestOutput] = []  # error outputs of requests a step ended alone
        self._exported_kv: dict[str, torch.Tensor] = {}
        self._exported_hashes: dict[str, list[int]] = {}
        self.groups: dict[str, SequenceGroup] = {}  # unfinished requests with several outputs
        # Structured outputs' compiled specs: on CUDA, several per spec, whose copies' masks fill in parallel.
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size,
                                        copies_per_spec=PARALLEL_TEMPLATES if self.runner.device.type == "cuda" else 1)

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request; ``ValueError`` says what is wrong with it."""
        prompt, outputs, params = list(request.prompt_token_ids), list(request.output_token_ids), request.params
        if request.request_id in self.scheduler.requests or request.request_id in self.groups:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.pooling is not None:
            self._add_embedding(request)
            return
        params = checked_params(params)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) > self.max_model_len - 1:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len {self.max_model_len} allows at most "
                f"{self.max_model_len - 1} so that one token can be generated"
            )
        all_ids = prompt + outputs
        if min(all_ids) < 0 or max(all_ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {min(all_ids)}..{max(all_ids)}")
        if outputs and (len(outputs) >= params.max_tokens or len(all_ids) >= self.max_model_len):
            raise ValueError(f"request {request.request_id!r} already has all its {len(outputs)} output tokens")
        outside = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {self.vocab_size})")
        if request.kv is not None:
            self._check_kv(request.kv, len(prompt), len(outputs))
        if request.adapter is not None:
            if self.adapters is None:
                raise ValueError(f"adapter {request.adapter.name!r} asked of a worker that serves no adapters: "
                                 "start it with --max-loras N")
            self.adapters.load(request.adapter)  # AdapterError (a ValueError) when it cannot be served
        prompt_logprobs = self._owed_prompt_logprobs(request, params)
        grammar = None
        if params.structured_output is not None:
            # A compile error or resumed tokens the spec refuses is the request's ValueError.
            grammar = self.grammars.output_grammar(params.structured_output)
            grammar.accept_all(outputs)
        group = None
        if params.num_candidates > 1:
            if outputs:
                raise ValueError(f"request {request.request_id!r} has several outputs: its first tokens are all "
                                 "sampled where the prompt's last token is computed (hand it off without them)")
            max_new = min(params.max_tokens, self.scheduler.max_seq_len - len(prompt))
            eos = frozenset() if params.ignore_eos else self.scheduler.eos_token_ids
            stops = frozenset(params.stop_token_ids) | eos
            group = SequenceGroup.create(request.request_id, params, stops, max_new)
        seq = Sequence(
            request_id=request.request_id,
            token_ids=all_ids,
            num_prompt_tokens=len(prompt),
            params=params if group is None else group.candidate_params[0],
            arrival=next(self._arrivals),
            prefill_only=request.prefill_only,
            # A group's outputs share blocks: offering each one's blocks to a KV-store is left out.
            export_on_finish=request.export_on_finish and group is None,
            pending_kv=request.kv,
            detokenizer=IncrementalDetokenizer(self.tokenizer, len(prompt), params.stop),
            group=group,
            fan_out=1 if group is None else group.prompt_fan_out(request.prefill_only),
            prompt_logprobs=prompt_logprobs,
            cumulative_logprob=request.output_cumulative_logprob,
            grammar=grammar,
            adapter=request.adapter,
            hash_root=adapter_hash_root(request.adapter),
        )
        if outputs:  # replay the prefill worker's text so deltas continue where it stopped
            # (stop strings looked for as it did: not in the text of the first min_tokens tokens)
            seq.detokenizer.update(seq.token_ids, seq.num_tokens, find_stops=len(outputs) > params.min_tokens)
            seq.detokenizer.take_delta(finished=False)
        self.scheduler.add(seq)
        if group is not None:
            group.live.append(seq)
            self.groups[request.request_id] = group

    def _add_embedding(self, request: EngineRequest) -> None:
        """Queue an embedding request: its whole prompt computed here, pooled, nothing sampled."""
        prompt, pooling = list(request.prompt_token_ids), request.pooling
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {min(prompt)}..{max(prompt)}")
        if request.kv is not None or request.output_token_ids or request.prefill_only or request.export_on_finish:
            raise ValueError("an embedding request computes its prompt here and ends there: no KV, output tokens, "
                             "hand-off or export")
        if pooling.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {pooling.method!r}")
        if pooling.dimensions is not None and pooling.dimensions > self.hidden_size:
            raise ValueError(f"dimensions is {pooling.dimensions}; the model's hidden size is {self.hidden_size}")
        self.scheduler.add(Sequence(
            request_id=request.request_id, token_ids=prompt, num_prompt_tokens=len(prompt), params=EMBEDDING_PARAMS,
            arrival=next(self._arrivals), detokenizer=IncrementalDetokenizer(self.tokenizer, len(prompt), []),
            fan_out=0,  # no row of its samples
            pooling=Pooling.of(pooling),
        ))

    def _owed_prompt_logprobs(self, request: EngineRequest, params: SamplingParams) -> PromptLogprobs | None:
        """The record of the prompt logprobs this engine computes for ``request``: none unless asked,
        nor for a hand-off (its prompt was computed, and its prompt logprobs sent, where its K/V
        come from). A prefix import is refused: the imported positions would have none."""
        if params.prompt_logprobs is None:
            return None
        if request.kv is None:
            return PromptLogprobs()
        if request.output_token_ids or request.kv.shape[0] * self.config.block_size >= len(request.prompt_token_ids):
            return None
        raise ValueError("prompt_logprobs need every prompt token computed here: import no prefix with them")

    def abort(self, request_id: str) -> bool:
        """Free the request's blocks now; its "abort" output comes from the next ``step``."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            seq = group.live[0]
            self._end_group(group, "abort")
        else:
            seq = self.scheduler.abort(request_id)
            if seq is None:
                return False
        self._aborted_outputs.append(self._make_output(seq, []))
        return True

    def _end_group(self, group: SequenceGroup, reason: str) -> None:
        """Finish every live sequence of ``group`` with ``reason`` (their blocks go back at once)."""
        for seq in group.live:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
        group.live.clear()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output per request that got a token or was aborted.

        With ``async_output`` the device computes this step while the host detokenizes the previous
        step's tokens, so a request's output arrives with the step after the one that sampled it
        (except sequences with stop strings, whose text decides when they end, and prefill-only
        ones, whose token starts a hand-off: see ``can_defer_text``). With ``overlap_steps`` a pure
        decode step is left running on the device and its tokens come out of the next call, which
        first queues the step after it (see ``overlap.py``). A request whose own part of the step
        raised gets its "error" output from this call; only a failure of the whole batch raises.
        """
        try:
            outputs = self._step()
        except BaseException:
            self._in_flight = None  # a failed step leaves nothing to wait for; its sequences get aborted
            raise
        if self._failed_rows:
            outputs += self._failed_rows
            self._failed_rows = []
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, self._queue_ahead(self._in_flight)
            outputs += self._catch_up_text()
            outputs += self._postprocess(done.batch, done.tokens)
            if self._in_flight is not None:
                if self._in_flight.tokens is None:  # its grammars have taken the step before's tokens now
                    self._in_flight.tokens = self._sample(self._in_flight.batch, self._in_flight.pending)
                return outputs
        batch = self.scheduler.schedule()
        if not batch:
            return outputs + self._catch_up_text()
        self._apply_swaps(batch)
        self._scatter_imports(batch)
        pending = self.runner.launch(batch)
        if self.overlap_steps and pending is not None and is_pure_decode(batch):
            self._in_flight = InFlightStep(batch, self._sample(batch, pending), pending)
            return outputs + self._catch_up_text()
        outputs += self._catch_up_text()
        return outputs + self._postprocess(batch, None if pending is None else self._sample(batch, pending))

    def _queue_ahead(self, step: InFlightStep) -> InFlightStep | None:
        """Queue the decode step after the in-flight ``step``, fed by its tokens on the device; None
        when the scheduler must decide the next step once ``step``'s tokens are known."""
        plan = plan_ahead(self.scheduler, step.batch)
        if plan is None:
            return None
        batch, rows = plan
        self._scatter_imports(batch)
        pending = self.runner.launch_decode([item.seq for item in batch.items], step.tokens.device, rows)
        self.num_overlapped_steps += 1
        if any(item.seq.grammar is not None for item in batch.items):
            # Its forward runs; its sampling waits until the host has the step before's tokens,
            # which its rows' grammars must take before their masks can be filled (see ``_step``).
            return InFlightStep(batch, None, pending)
        return InFlightStep(batch, self._sample(batch, pending), pending)

    def _sample(self, batch: ScheduledBatch, pending: PendingStep) -> SampledTokens:
        """Queue the sampling of ``batch``'s launched step; a row whose own sampling raised ends its
        request alone (its id is a placeholder that postprocessing skips, the sequence being finished).
        Constrained rows' masks are filled here, while the device runs the step's forward."""
        tokens = self.runner.sample_async(pending, self._token_bitmask(pending))
        for row, exc in tokens.failed_rows.items():
            if not pending.seqs[row].is_finished:  # a group's prompt has a row per candidate
                self._fail_row(pending.seqs[row], exc)
        return tokens

    def _token_bitmask(self, pending: PendingStep) -> TokenBitmask | None:
        """The masks of the step's constrained rows; a row no token can continue ends its request
        with an error (its spec admits nothing there) and is sampled unmasked, its token dropped."""
        rows = [(row, seq.grammar) for row, seq in enumerate(pending.seqs)
                if seq.grammar is not None and not seq.is_finished]
        if not rows:
            return None
        started = time.perf_counter()
        bitmask = fill_bitmask(rows, self.vocab_size, parallel=self.runner.device.type == "cuda")
        self.grammars.stats.mask_fills += 1
        self.grammars.stats.mask_fill_seconds += time.perf_counter() - started
        if bitmask is None:
            return None
        stuck = bitmask.empty_rows()
        for row in stuck:
            seq = pending.seqs[row]
            if not seq.is_finished:
                self._fail_row(seq, GrammarViolation("structured output: no token can continue the output here "
                                                     "(the schema or grammar admits nothing more); check it"))
        return bitmask.without(stuck) if stuck else bitmask

    def _apply_swaps(self, batch: ScheduledBatch) -> None:
        """Queue the batch's swap copies, swap-outs first, before anything else of it.

        Queueing is enough, nothing waits: every copy and kernel of the engine goes on the current
        stream, in the order the host queues it. A swap-out's copy is queued after the steps that
        wrote its blocks and before this batch's swap-ins, copy-on-write copies, imports and
        forward, the first that may write into the device blocks it freed; a swap-in's copy before
        the forward that reads it. A host block is written by a swap-out and read by a swap-in,
        both on that stream, and the host itself never touches the swap space.
        """
        if batch.swap_out:
            self.runner.swap_out(batch.swap_out)
        if batch.swap_in:
            self.runner.swap_in(batch.swap_in)

    def _scatter_imports(self, batch: ScheduledBatch) -> None:
        """Write the batch's imported K/V and copy-on-write copies into the cache (queued before its forward)."""
        self.runner.copy_blocks(batch.copies)
        for seq, kv, first in batch.imports:
            if kv.shape[0]:
                self.runner.import_kv(seq.block_table[first:], kv)
            self.scheduler.hash_computed(seq)  # its prompt blocks hold valid K/V now: cacheable

    def _postprocess(self, batch: ScheduledBatch, tokens: SampledTokens | None) -> list[RequestOutput]:
        """Append ``tokens`` (the step's sampled rows, None when no item sampled) to their sequences."""
        outputs = []
        sampled = [] if tokens is None else tokens.wait()
        sampled_logprobs = None if tokens is None else tokens.wait_logprobs()
        row = 0
        beam_groups: dict[str, SequenceGroup] = {}  # searches with a beam stepped in this batch
        for item in batch.items:
            count = item.seq.fan_out if item.samples else 0  # the item's rows (several: a group's prompt)
            ids = sampled[row : row + count]
            row_logprobs = [None] * count if sampled_logprobs is None else sampled_logprobs[row : row + count]
            row += count
            if item.seq.group is not None:
                outputs += self._postprocess_group_item(item, ids, row_logprobs, beam_groups)
                continue
            if item.seq.pooling is not None:
                outputs += self._postprocess_embedding(item)
                continue
            token_id = ids[0] if ids else None
            logprobs = row_logprobs[0] if ids else None
            try:
                if not self.scheduler.postprocess_item(item, token_id, text_later=self.async_output):
                    continue
                seq = item.seq
                if logprobs is not None:
                    seq.cumulative_logprob += logprobs.logprob
                if self.async_output and can_defer_text(seq):
                    self._text_pending.append((seq, seq.token_ids[-1], logprobs))
                else:
                    outputs.append(self._make_output(seq, seq.token_ids[-1:], logprobs))
            except Exception as exc:  # this row's own work: it alone ends
                self._fail_row(item.seq, exc)
        for group in beam_groups.values():
            beam = group.live[0]
            try:
                outputs += self._beam_step(group)
            except Exception as exc:  # the search's own work: this request alone ends
                self._fail_row(beam, exc)
        return outputs

    def _postprocess_embedding(self, item: ScheduledSequence) -> list[RequestOutput]:
        """``_postprocess`` for an embedding's item: its prompt's last chunk ends it with its vector."""
        seq = item.seq
        try:
            if not self.scheduler.advance(item) or not item.samples:
                return []
            self.scheduler.finish(seq, EMBEDDED)
            return [self._make_output(seq, [])]
        except Exception as exc:  # this row's own work: it alone ends
            self._fail_row(seq, exc)
            return []

    # -- requests with several outputs (see sequence_group.py) -------------------------------------
    def _postprocess_group_item(self, item: ScheduledSequence, ids: list[int], logprobs: list,
                                beam_groups: dict[str, SequenceGroup]) -> list[RequestOutput]:
        """``_postprocess`` for one item of a group: ``ids``/``logprobs`` are its rows' (one per
        candidate for the group's prompt, one for a sample or a beam, none for a partial chunk)."""
        seq, group = item.seq, item.seq.group
        try:
            if not self.scheduler.advance(item) or not item.samples:
                return []
            if seq.fan_out == 0:  # the prompt prefilled for a hand-off: the decode worker samples
                self.scheduler.finish(seq, "prefilled")
                group.live.clear()
                del self.groups[group.request_id]
                return [self._make_output(seq, [])]
            if group.is_beam_search:
                seq.beam_candidates = list(logprobs[0].top)
                beam_groups[group.request_id] = group
                return []
            samples = [seq]
            if seq.fan_out > 1:  # the prompt's logits start every candidate: fork them off it
                samples += [self._fork(group, seq) for _ in range(seq.fan_out - 1)]
                seq.fan_out = 1
            outputs = []
            for sample, token_id, entry in zip(samples, ids, logprobs):
                self.scheduler.append_token(sample, token_id)
                outputs += self._sample_outputs(group, sample, entry)
            return outputs
        except Exception as exc:
            self._fail_row(seq, exc)
            return []

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence of ``group`` sharing ``parent``'s blocks, text state and tokens so far."""
        child = self.scheduler.fork(parent, group.next_index)
        child.detokenizer = copy.copy(parent.detokenizer)
        if not group.is_beam_search:
            child.params = group.candidate_params[group.next_index]
            group.live.append(child)
        group.next_index += 1
        return child

    def _sample_outputs(self, group: SequenceGroup, seq: Sequence, entry: TokenLogprobs) -> list[RequestOutput]:
        """What a sample's new token reports: its output when outputs stream, else nothing until the
        request ends, when the ``n`` best samples are reported whole."""
        seq.cumulative_logprob += entry.logprob
        wants_logprobs = group.params.logprobs is not None
        if seq.is_finished:
            group.live.remove(seq)
            group.ended.append(seq)
        if group.params.holds_outputs:
            if wants_logprobs:
                seq.held_logprobs.append(entry)
            if group.live:
                return []
            del self.groups[group.request_id]
            best = group.ranked_samples()
            return [self._held_output(seq, rank, len(best), sample.output_token_ids,
                                      sample.detokenizer.take_delta(True), sample.finish_reason,
                                      sample.cumulative_logprob, sample.held_logprobs if wants_logprobs else None)
                    for rank, sample in enumerate(best)]
        if not group.live:
            del self.groups[group.request_id]
        return [self._make_output(seq, seq.token_ids[-1:], entry if wants_logprobs else None)]

    def _beam_step(self, group: SequenceGroup) -> list[RequestOutput]:
        """Once every live beam of ``group`` has its candidates: pick the next beams and carry the
        choice out (a beam picked once goes on, picked again forks, not picked is freed at once);
        when the search ends, report its ``n`` best hypotheses."""
        beams = list(group.live)
        if any(beam.beam_candidates is None for beam in beams):
            return []  # a beam was preempted or not scheduled this step: the search waits for it
        candidates = [beam.beam_candidates for beam in beams]
        for beam in beams:
            beam.beam_candidates = None
        keep = group.params.logprobs
        step = group.beams.step([beam.cumulative_logprob for beam in beams], candidates,
                                [(beam.output_token_ids, beam.held_logprobs) for beam in beams],
                                beams[0].num_output_tokens, keep)
        if step.done:
            self._end_group(group, "pruned")
            del self.groups[group.request_id]
            best = group.beams.best(group.params.n) or self._unfinished_beams(group, step, beams, candidates)
            return [self._beam_output(beams[0], rank, len(best), hyp) for rank, hyp in enumerate(best)]
        picked: dict[int, list] = {}
        for cont in step.next_beams:
            picked.setdefault(cont.parent, []).append(cont)
        for index, beam in enumerate(beams):
            if index not in picked:
                self.scheduler.finish(beam, "pruned")  # its blocks go back now (shared ones lose a reference)
        heirs: dict[int, Sequence] = {}
        for index, conts in picked.items():
            beam = beams[index]
            for cont, heir in zip(conts, [beam] + [self._fork(group, beam) for _ in conts[1:]]):
                heirs[cont.rank] = heir
                heir.token_ids.append(cont.token_id)
                heir.cumulative_logprob = cont.score
                heir.held_logprobs = heir.held_logprobs + token_entry(cont, candidates, keep)
        group.live = [heirs[cont.rank] for cont in step.next_beams]
        return []

    @staticmethod
    def _unfinished_beams(group: SequenceGroup, step, beams: list[Sequence], candidates: list) -> list[BeamHypothesis]:
        """Fallback when a search ends with nothing finished: its best live continuations."""
        return [BeamHypothesis([*beams[c.parent].output_token_ids, c.token_id], c.score, c.score,
                               [*beams[c.parent].held_logprobs, *token_entry(c, candidates, group.params.logprobs)],
                               stopped=False) for c in step.next_beams[: group.params.n]]

    def _beam_output(self, seq: Sequence, rank: int, count: int, hyp: BeamHypothesis) -> RequestOutput:
        detok = IncrementalDetokenizer(self.tokenizer, seq.num_prompt_tokens, [])
        text_ids = seq.token_ids[: seq.num_prompt_tokens] + hyp.token_ids[: len(hyp.token_ids) - hyp.stopped]
        detok.update(text_ids, len(text_ids), final=True)
        logprobs = hyp.logprobs if seq.group.params.logprobs is not None else None
        return self._held_output(seq, rank, count, hyp.token_ids, detok.text, "stop" if hyp.stopped else "length",
                                 hyp.cumulative_logprob, logprobs)

    @staticmethod
    def _held_output(seq: Sequence, rank: int, count: int, token_ids: list[int], text: str, reason: str | None,
                     cumulative_logprob: float, logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """One of a request's held outputs, reported whole when it ends: ``rank`` of ``count``, best
        first; the best one brings the prompt logprobs when they were asked for (``seq`` is any of
        the group's sequences: they share that record)."""
        prompt_logprobs = None
        if rank == 0 and seq.prompt_logprobs is not None:
            prompt_logprobs = seq.prompt_logprobs.take(seq.num_prompt_tokens)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=list(token_ids), text_delta=text, finished=True,
            finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=len(token_ids),
            logprobs=logprobs, sample_index=rank, cumulative_logprob=cumulative_logprob,
            request_finished=rank == count - 1, prompt_logprobs=prompt_logprobs)

    def _catch_up_text(self) -> list[RequestOutput]:
        pending, self._text_pending = self._text_pending, []
        outputs = []
        for seq, token, logprobs in pending:
            if seq.finish_reason in ENDED_APART:
                continue  # its abort or error output already went out
            try:
                catch_up_text(seq)
                outputs.append(self._make_output(seq, [token], logprobs))
            except Exception as exc:
                self._fail_row(seq, exc)
        return outputs

    def _fail_row(self, seq: Sequence, exc: Exception) -> None:
        """End ``seq`` alone because its own part of a step raised ``exc``: its blocks go back (as
        with an abort) and its "error" output comes from this ``step``; the batch goes on."""
        group = seq.group
        if group is not None and self.groups.get(group.request_id) is not group:
            return  # its request already ended (another of its rows failed first)
        log.warning("request %s failed in its own part of an engine step and ends alone; the rest of "
                    "the batch goes on", seq.request_id, exc_info=exc)
        self.scheduler.fail(seq, f"{type(exc).__name__}: {exc}")
        if group is not None:  # one output failing ends the request: the others end with it
            self._end_group(group, "abort")
            del self.groups[group.request_id]
        self._exported_kv.pop(seq.request_id, None)  # exported before its output failed
        self._exported_hashes.pop(seq.request_id, None)
        self._failed_rows.append(self._make_output(seq, []))

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._aborted_outputs)
                or bool(self._text_pending) or bool(self._failed_rows))

    # -- what services read (engine_view.py: nothing outside shared/engine reads the parts) -----------
    def stats(self) -> EngineStats:
        cache = self.adapters
        running: list[str] = []  # adapter names of the running, and of the waiting or swapped, sequences
        waiting: list[str] = []
        if cache is not None:
            queued = itertools.chain(self.scheduler.waiting, self.scheduler.swapped)
            running = sorted({seq.adapter.name for seq in self.scheduler.running if seq.adapter is not None})
            waiting = sorted({seq.adapter.name for seq in queued if seq.adapter is not None})
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "usage": self.block_manager.usage,
            "preemptions": self.scheduler.num_preemptions,  # by swap and by recompute
            "swaps": self.scheduler.num_swaps,  # preemptions by swap
            "recomputes": self.scheduler.num_recomputes,  # preemptions by recompute
            "swap_fallbacks": self.scheduler.num_swap_fallbacks,  # swapped, then recomputed after all
            "swapped": len(self.scheduler.swapped),
            "swap_blocks": 0 if self.swap_space is None else self.swap_space.num_blocks,
            "free_swap_blocks": 0 if self.swap_space is None else self.swap_space.num_free_blocks,
            "swap_usage": 0.0 if self.swap_space is None else self.swap_space.usage,
            "prefix_cache_queries": self.block_manager.prefix_queries,  # tokens looked up at admission
            "prefix_cache_hits": self.block_manager.prefix_hits,  # of those, tokens found cached
            "cached_blocks": self.block_manager.num_cached_blocks,  # free but holding a cached prefix
            "cow_copies": self.block_manager.num_cow_copies,  # blocks copied on a forked sequence's first write
            # LoRA (all 0 or empty without adapter slots): read here, on the engine thread, so the
            # worker's heartbeats and metrics never walk the cache or the queues while a step moves them.
            "adapter_loads": 0 if cache is None else cache.loads,  # adapters read from disk
            "adapter_slot_writes": 0 if cache is None else cache.slot_writes,  # adapters copied into a slot
            "adapters_resident": [] if cache is None else cache.resident(),  # name@version, in slots
            "adapters_running": running,
            "adapters_waiting": waiting,
        }

    @property
    def kv_layout(self) -> tuple[int, ...]:
        """The shape of one exported or imported KV block (``RequestOutput.kv[i]``, ``EngineRequest.kv[i]``)."""
        return self.runner.kv_layout

    def running_request_ids(self) -> list[str]:
        """Requests with a running sequence, by arrival (a request with several outputs once)."""
        return list(dict.fromkeys(seq.request_id for seq in self.scheduler.running))

    def sequences(self, limit: int | None = None) -> list[SequenceView]:
        """Unfinished sequences: running, then waiting, then swapped, each by arrival; at most ``limit``."""
        queues = itertools.chain(self.scheduler.running, self.scheduler.waiting, self.scheduler.swapped)
        return [SequenceView(request_id=seq.request_id, sample_index=seq.sample_index, status=seq.status.value,
                             num_tokens=seq.num_tokens, num_output_tokens=seq.num_output_tokens,
                             block_table=tuple(seq.block_table), prefix_cached_blocks=seq.prefix_cached_blocks,
                             imported_blocks=seq.imported_blocks, constrained=constrained_kind(seq.params),
                             adapter=seq.adapter.name if seq.adapter is not None else "")
                for seq in itertools.islice(queues, limit)]

    def kv_pool(self) -> KVPoolView:
        """The device KV pool's blocks as they are now."""
        blocks = self.block_manager.blocks
        return KVPoolView(num_blocks=self.block_manager.num_blocks, block_size=self.block_manager.block_size,
                          ref_counts=tuple(block.ref_count for block in blocks),
                          cached=tuple(block.block_hash is not None for block in blocks),
                          cow_copies=self.block_manager.num_cow_copies)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights (same names and shapes) into the served model, in place, and forget every
        cached prefix (its K/V came from the old weights). Only while no request is unfinished."""
        if self.has_unfinished():
            raise RuntimeError("weights can only change while no request is in flight")
        self.runner.load_weights(state_dict)  # a tensor-parallel runner cuts each tensor for every rank
        self.block_manager.reset_prefix_cache()

    def prepare_structured_outputs(self) -> None:
        """Build the vocabulary's token table for grammars now (a worker at start-up), not in the
        step of the first structured request, where a large vocabulary's would stall every row.
        A tokenizer it cannot read leaves the worker serving: its structured requests are refused."""
        try:
            _ = self.grammars.vocabulary
        except ValueError as exc:
            log.warning("structured outputs will be refused: %s", exc)

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)`` block hashes since the last call, net; see ``BlockManager.drain_events``.

        Call it on the thread that steps the engine (e.g. after each ``step``).
        """
        return self.block_manager.drain_events()

    def _make_output(self, seq: Sequence, new_token_ids: list[int],
                     logprobs: TokenLogprobs | None = None) -> RequestOutput:
        reason = seq.finish_reason
        finished = seq.status is SequenceStatus.FINISHED
        # "prefilled" is a hand-off, not an end: keep held-back text for the decode worker to send.
        # An error output never touches the detokenizer: it may be what failed.
        text = "" if reason in ENDED_APART else seq.detokenizer.take_delta(finished and reason != "prefilled")
        # The request's first output made after its prompt was computed carries its prompt logprobs.
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and reason not in ENDED_APART:
            prompt_logprobs = seq.prompt_logprobs.take(seq.num_prompt_tokens)
        group = seq.group
        reports_logprobs = (seq.params if group is None else group.params).logprobs is not None or group is not None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            text_delta=text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            kv=self._exported_kv.pop(seq.request_id, None),
            kv_hashes=self._exported_hashes.pop(seq.request_id, None),
            error=seq.error,
            logprobs=None if logprobs is None else [logprobs],
            prompt_logprobs=prompt_logprobs,
            sample_index=seq.sample_index,
            cumulative_logprob=seq.cumulative_logprob if finished and reports_logprobs else None,
            # A group's request ends with the output made once it left ``groups``.
            request_finished=None if group is None else finished and self.groups.get(group.request_id) is not group,
            embedding=seq.pooling.result() if reason == EMBEDDED else None,
        )

    def _on_finish(self, seq: Sequence) -> None:
        # Gathered before the scheduler frees the blocks.
        if seq.finish_reason == "prefilled":
            # Every computed token: the prompt's, and a migrated request's resumed output tokens
            # (computed with it), so the decode worker recomputes none of them.
            self._exported_kv[seq.request_id] = self.runner.export_kv(seq.block_table, seq.num_computed_tokens)
        elif seq.export_on_finish and seq.finish_reason not in ENDED_APART:
            full = seq.num_computed_tokens // self.config.block_size * self.config.block_size
            if full:
                self._exported_kv[seq.request_id] = self.runner.export_kv(seq.block_table, full)
                self._exported_hashes[seq.request_id] = prefix_hashes(seq.token_ids[:full], self.config.block_size,
                                                                      seq.hash_root)

    def _check_kv(self, kv: torch.Tensor, num_prompt_tokens: int, num_outputs: int) -> None:
        """Imported K/V cover the first tokens of the request, whatever else is computed here: a
        hand-off with output tokens (the one sampled after the prompt, after a migrated request's
        resumed ones) covers every token but the last sampled one; a prefix fetched from a KV-store
        covers leading whole blocks of the prompt (a migrated request's resumed tokens are then
        computed with the rest of it); without a sampled token (a prefix, or a group's prompt handed
        off to sample its candidates here) it covers at most the whole prompt, and the last prompt
        token is computed here anyway so that there are logits to sample from."""
        layout = self.runner.kv_layout
        if kv.dim() != 1 + len(layout) or tuple(kv.shape[1:]) != layout:
            raise ValueError(f"kv has shape {tuple(kv.shape)}, expected (n, {', '.join(map(str, layout))})")
        whole = -(-num_prompt_tokens // self.config.block_size)
        if num_outputs:
            computed = -(-(num_prompt_tokens + num_outputs - 1) // self.config.block_size)
            prefix = num_prompt_tokens // self.config.block_size  # whole prompt blocks
            if kv.shape[0] != computed and not 0 < kv.shape[0] <= prefix:
                raise ValueError(f"kv for a request with output tokens is a hand-off's {computed} blocks (its prompt "
                                 f"and its output tokens but the last) or a prefix of at most its prompt's {prefix} "
                                 f"whole blocks, got {kv.shape[0]}")
        elif not 0 < kv.shape[0] <= whole:
            raise ValueError(f"an import without sampled tokens covers at most the prompt's {whole} blocks, "
                             f"got {kv.shape[0]}")
