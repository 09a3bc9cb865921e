"""``LLMEngine``: the synchronous engine core the prefill and decode services run in a worker thread.

``step()`` = schedule a batch -> scatter imported KV -> run the model and sample -> postprocess
(append tokens, stop checks, free finished) -> one ``RequestOutput`` per request that got a token.

Prefill/decode hand-off: a ``prefill_only`` request finishes right after its first sampled token
with reason "prefilled" and its output carries the prompt's KV (gathered before the blocks are
freed). If that first token already ends the request (eos, stop, length) the normal reason is
reported and no KV is attached. The decode engine takes the request with ``kv`` and
``output_token_ids`` set and continues from token 1; its text deltas continue where the prefill
worker's stopped (held-back text is re-derived, never sent twice).

Prefix caching (``EngineConfig.enable_prefix_caching``, vLLM-style automatic prefix caching): full
blocks stay in the pool after their sequence ends, keyed by chained block hash, and a new or
re-prefilling sequence starts from the longest cached prefix of its tokens (see the scheduler).
Imported blocks are hashed right after they are scattered in, so they are cacheable too.
``drain_kv_events`` hands the services the hashes this engine started / stopped holding.

Row failures: a request whose own part of a step raises (sampling its row, appending its token,
its stop checks, its text) ends alone with reason "error" and its ``RequestOutput.error``; its blocks
go back as with an abort and the rest of the batch goes on as if it had not been there. What fails
for the batch as a whole (the forward, a device out of memory) still raises from ``step``.
"""

from __future__ import annotations

import itertools
import logging

import torch

from tandem.shared.engine.detokenizer import IncrementalDetokenizer, can_defer_text, catch_up_text
from tandem.shared.engine.model_runner import ModelRunner, PendingStep, SampledTokens
from tandem.shared.engine.overlap import InFlightStep, is_pure_decode, plan_ahead
from tandem.shared.engine.scheduler import ScheduledBatch, Scheduler
from tandem.shared.engine.sequence import EngineRequest, RequestOutput, Sequence, SequenceStatus, checked_params
from tandem.shared.infra.config import EngineSettings
from tandem.shared.kvcache.block_manager import BlockManager
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.serving import TokenLogprobs
from tandem.shared.text.tokenizer import Tokenizer

# The engine's config is the settings' engine section: one class, so a knob added there (with its
# flag and TANDEM_ variable) reaches the engine without another edit. Fields the engine reads:
# block_size, num_blocks (>= 1 here: 0, "size from memory", is the worker's to resolve),
# max_num_seqs, max_num_batched_tokens (query tokens per step: decodes + prefill chunks),
# max_model_len (also capped by the model's RoPE table), enable_prefix_caching (off: no lookups, no
# cached blocks, no KV events), enforce_eager (CUDA: no decode graphs), async_output (detokenize a
# step's tokens while the device runs the next step; None: on for CUDA, where the forward runs
# asynchronously to the host) and overlap_steps (queue the next decode step before the host has this
# one's tokens, see ``overlap.py``; None: on with CUDA graphs, off otherwise). device, dtype and the
# memory budgets are the worker's: ``LLMEngine`` takes the resolved device and dtype as arguments.
EngineConfig = EngineSettings

log = logging.getLogger("tandem.engine")

# Finish reasons whose output is made when the sequence ends, not by a step's token: no text, no KV.
ENDED_APART = ("abort", "error")


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
        self.max_model_len = min(config.max_model_len, model.config.max_position_embeddings)
        dtype = dtype if dtype is not None else next(model.parameters()).dtype
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=tokenizer.eos_token_ids,
            on_finish=self._on_finish,
        )
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, device, dtype,
                                  cuda_graph_max_batch=0 if config.enforce_eager else config.max_num_seqs,
                                  max_model_len=self.max_model_len)
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

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request; ``ValueError`` says what is wrong with it."""
        prompt, outputs, params = list(request.prompt_token_ids), list(request.output_token_ids), request.params
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
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
        if request.kv is not None:
            self._check_kv(request.kv, len(prompt), bool(outputs))
        seq = Sequence(
            request_id=request.request_id,
            token_ids=all_ids,
            num_prompt_tokens=len(prompt),
            params=params,
            arrival=next(self._arrivals),
            prefill_only=request.prefill_only,
            export_on_finish=request.export_on_finish,
            pending_kv=request.kv,
            detokenizer=IncrementalDetokenizer(self.tokenizer, len(prompt), params.stop),
        )
        if outputs:  # replay the prefill worker's text so deltas continue where it stopped
            seq.detokenizer.update(seq.token_ids, seq.num_tokens)
            seq.detokenizer.take_delta(finished=False)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Free the request's blocks now; its "abort" output comes from the next ``step``."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._aborted_outputs.append(self._make_output(seq, []))
        return True

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
                return outputs
        batch = self.scheduler.schedule()
        if not batch:
            return outputs + self._catch_up_text()
        self._scatter_imports(batch)
        pending = self.runner.launch(batch)
        if self.overlap_steps and pending is not None and is_pure_decode(batch):
            self._in_flight = InFlightStep(batch, self._sample(batch, pending))
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
        return InFlightStep(batch, self._sample(batch, pending))

    def _sample(self, batch: ScheduledBatch, pending: PendingStep) -> SampledTokens:
        """Queue the sampling of ``batch``'s launched step; a row whose own sampling raised ends its
        request alone (its id is a placeholder that postprocessing skips, the sequence being finished)."""
        tokens = self.runner.sample_async(pending)
        if tokens.failed_rows:
            sampling = [item.seq for item in batch.items if item.samples]  # the step's rows, in order
            for row, exc in tokens.failed_rows.items():
                self._fail_row(sampling[row], exc)
        return tokens

    def _scatter_imports(self, batch: ScheduledBatch) -> None:
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
        for item in batch.items:
            token_id = logprobs = None
            if item.samples:
                token_id = sampled[row]
                logprobs = None if sampled_logprobs is None else sampled_logprobs[row]
                row += 1
            try:
                if not self.scheduler.postprocess_item(item, token_id, text_later=self.async_output):
                    continue
                seq = item.seq
                if self.async_output and can_defer_text(seq):
                    self._text_pending.append((seq, seq.token_ids[-1], logprobs))
                else:
                    outputs.append(self._make_output(seq, seq.token_ids[-1:], logprobs))
            except Exception as exc:  # this row's own work: it alone ends
                self._fail_row(item.seq, exc)
        return outputs

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
        log.warning("request %s failed in its own part of an engine step and ends alone; the rest of "
                    "the batch goes on", seq.request_id, exc_info=exc)
        self.scheduler.fail(seq, f"{type(exc).__name__}: {exc}")
        self._exported_kv.pop(seq.request_id, None)  # exported before its output failed
        self._exported_hashes.pop(seq.request_id, None)
        self._failed_rows.append(self._make_output(seq, []))

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._aborted_outputs)
                or bool(self._text_pending) or bool(self._failed_rows))

    def stats(self) -> dict[str, float | int]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "usage": self.block_manager.usage,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.block_manager.prefix_queries,  # tokens looked up at admission
            "prefix_cache_hits": self.block_manager.prefix_hits,  # of those, tokens found cached
            "cached_blocks": self.block_manager.num_cached_blocks,  # free but holding a cached prefix
        }

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights (same names and shapes) into the served model, in place, and forget every
        cached prefix (its K/V came from the old weights). Only while no request is unfinished."""
        if self.has_unfinished():
            raise RuntimeError("weights can only change while no request is in flight")
        with torch.no_grad():
            self.runner.model.load_state_dict(state_dict, strict=False)
        self.block_manager.reset_prefix_cache()

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
        )

    def _on_finish(self, seq: Sequence) -> None:
        # Gathered before the scheduler frees the blocks.
        if seq.finish_reason == "prefilled":
            self._exported_kv[seq.request_id] = self.runner.export_kv(seq.block_table, seq.num_prompt_tokens)
        elif seq.export_on_finish and seq.finish_reason not in ENDED_APART:
            full = seq.num_computed_tokens // self.config.block_size * self.config.block_size
            if full:
                self._exported_kv[seq.request_id] = self.runner.export_kv(seq.block_table, full)
                self._exported_hashes[seq.request_id] = prefix_hashes(seq.token_ids[:full], self.config.block_size)

    def _check_kv(self, kv: torch.Tensor, num_prompt_tokens: int, has_outputs: bool) -> None:
        """Two kinds of imported K/V: a hand-off covers the whole prompt and comes with the token
        sampled after it; a prefix (fetched from a KV-store) covers only full blocks before the
        prompt's last token, which is computed here so that there are logits to sample from."""
        layout = tuple(self.runner.kv_cache.shape[1:])
        if kv.dim() != 1 + len(layout) or tuple(kv.shape[1:]) != layout:
            raise ValueError(f"kv has shape {tuple(kv.shape)}, expected (n, {', '.join(map(str, layout))})")
        whole = -(-num_prompt_tokens // self.config.block_size)
        if has_outputs and kv.shape[0] != whole:
            raise ValueError(f"a hand-off needs the prompt's {whole} blocks of kv, got {kv.shape[0]}")
        if not has_outputs and not 0 < kv.shape[0] * self.config.block_size < num_prompt_tokens:
            raise ValueError(
                f"a prefix import covers full blocks before the prompt's last token: at most "
                f"{(num_prompt_tokens - 1) // self.config.block_size} blocks, got {kv.shape[0]}"
            )
