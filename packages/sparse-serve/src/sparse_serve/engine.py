"""The engine loop: schedule, run, postprocess."""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import logging
import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import sparse_methods
from sparse_cache import ChainInfo, KVCacheManager, LayerLayout
from sparse_methods import ModelShape, PrefillPolicy, PrefixCacheMode, StoreKind, Support, build_method
from sparse_models import ModelConfig, read_model_config
from sparse_models.distributed import rank_attention_config, tp_world_size
from sparse_serve.chains import EngineChains
from sparse_serve.config import EngineConfig
from sparse_serve.detokenizer import IncrementalDetokenizer
from sparse_serve.kv_compaction import apply_compaction, apply_compactions, apply_lane_compaction
from sparse_serve.model_runner import ModelRunner
from sparse_serve.outputs import RequestOutput
from sparse_serve.prune import PruneResult, prune_history
from sparse_serve.rank_head_reduction import head_reduction
from sparse_serve.request import Request, RequestStatus
from sparse_serve.sampler import PromptRows, SampledTokens, TokenFeed, TokenLogprobs
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.scheduler import ScheduledBatch, Scheduler
from sparse_serve.step_metadata import StepMetadata, build_step_metadata
from sparse_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Stands in a request's token list for a token still on the device (pipelined decode, never emitted).
_PLACEHOLDER = -1


@dataclass(slots=True)
class _LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not taken yet.

    pipelined : the next step may be scheduled and launched before these tokens are known.
    placeholders : its sampled requests hold ``_PLACEHOLDER`` for the token (the next step is built).
    observed : requests whose attention the method observed in the step (its state took the step in).
    """

    batch: ScheduledBatch
    meta: StepMetadata
    pending: SampledTokens
    compactions: Mapping
    pipelined: bool
    observed: frozenset = frozenset()
    placeholders: bool = False


class LLMEngine:
    """Accepts requests and advances all of them one step at a time.

    With ``async_scheduling`` decode steps are pipelined: ``step()`` schedules, plans and launches
    step N+1 while step N runs on the device (N+1's input ids are N's sampled tokens, copied on the
    device), then takes N's tokens and returns N's outputs, so each call still returns one step's
    outputs and each request gets the tokens it gets without pipelining (a request added meanwhile
    joins at N+2). Decode-only steps with no request on a chain are pipelined, those that observe
    attention or compact included (see ``_pipelinable``); anything else runs synchronously. A request
    that stops at N (EOS, stop ids or strings, abort) was already in N+1: that row is dropped, never emitted; its
    blocks are freed at once on the host, which is safe because every later device use of them is
    queued behind N+1 on the same stream. Requests whose token at N reaches their length limit sit
    N+1 out.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        model_cfg = _checked_model_config(config)
        model_max_len = model_cfg.max_position_embeddings  # sliding windows are applied in the kernels
        _check_tensor_parallel(config)
        self.method = _checked_method(config, model_cfg)
        self.num_layers = model_cfg.num_hidden_layers
        layout = self._layer_layout(model_cfg.layer_sliding_windows, config.max_model_len or model_max_len)
        if self.method.storage.kind is StoreKind.HEAD_MAJOR and model_cfg.mla is None:  # a table per (layer, KV head)
            layout = LayerLayout.head_major(self.num_layers, self.method.shape.num_kv_heads)  # this rank's
        self.runner = ModelRunner(config, model_cfg, config.max_model_len or model_max_len, self.method, layout)
        self.max_model_len = self._resolve_max_model_len(model_max_len)
        cfg = self.runner.model_config
        self.tokenizer = _load_tokenizer(config.tokenizer or config.model, cfg.eos_token_ids)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset(cfg.eos_token_ids)
        self.runner.sampler.eos_token_ids = self.eos_token_ids  # what min_tokens keeps from being sampled
        # Radix sharing needs token-exact KV; evicting methods resume through chains instead.
        exact_kv = self.method.prefix_cache_mode is PrefixCacheMode.RADIX
        self.kv = KVCacheManager(
            self.runner.num_pool_blocks,
            config.block_size,
            layout=layout,
            enable_prefix_caching=config.enable_prefix_caching and exact_kv,
            salt=self._cache_salt(),
            max_chains=config.max_num_chains,
        )
        if self.kv.null_block is not None:
            self.runner.clear_block(self.kv.null_block)
        self.chains = EngineChains(self.kv, self.runner.kv, self.runner.tail_rows)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_peak=self._prefill_peak,
            full_prefill=self._full_prefill,
            compacts=not exact_kv,
        )
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.runner.device.type == "cuda"
        )
        self._inflight: _LaunchedStep | None = None  # launched, tokens not yet taken (pipelined only)
        self._stashed: list[RequestOutput] = []  # outputs of a step drained outside ``step()``
        self.num_pipelined_steps = 0  # steps launched before the previous step's tokens were known
        # A step's compactions in one launch per layer (``_advance_many``); False: request by request
        # (``_advance``, the reference the batched path is tested against).
        self.batched_compaction = True
        if self.runner.device.type == "cuda":
            # What start-up made (the model, its weights' Python objects) lives as long as the engine: moved
            # out of the collector's generations, a full collection during serving no longer walks it (as
            # vLLM does after start-up). A full collection at start-up took 130-150 ms on the H200 host
            # (session 13, logged through gc.callbacks): one inside a decode step would stall the pipeline that
            # long. On CPU (tests) engines come and go: nothing is frozen.
            gc.collect()
            gc.freeze()
            if config.host_threads:  # the host's small ops on one thread: no worker to wait for
                torch.set_num_threads(config.host_threads)

    def _layer_layout(self, windows, max_len: int) -> LayerLayout:
        """One table per layer when layers hold different amounts: some layer slides over a window (its
        blocks before the window are given back) or the method plans different tokens per layer (for some
        prompt length up to ``max_len``: PyramidKV's budgets); else the shared table (the fast path)."""
        lengths = {max(1, max_len - 1)} | {n for n in (max_len >> k for k in range(1, 20)) if n >= 16}
        plans = [self.method.memory_plan(n, 1, self.config.max_num_batched_tokens) for n in sorted(lengths)]
        return LayerLayout.choose(
            self.num_layers,
            tuple(None if w is None else w - 1 for w in windows),  # the kernels' window_left (HF W: w - 1)
            [tokens for p in plans for tokens in (p.prefill_peak_tokens, p.resident_tokens, p.decode_peak_tokens)],
        )

    def _resolve_max_model_len(self, model_max_len: int) -> int:
        capacity = self.runner.num_blocks * self.config.block_size
        wanted = self.config.max_model_len
        if wanted is not None and wanted > capacity:
            raise ValueError(
                f"max_model_len={wanted} does not fit the KV pool ({self.runner.num_blocks} blocks of "
                f"{self.config.block_size} = {capacity} tokens); raise the KV memory or lower max_model_len"
            )
        return min(wanted or model_max_len, capacity)

    def _cache_salt(self) -> bytes:
        cfg = self.config
        fingerprint = {
            "model": str(Path(cfg.model).resolve()),
            "dtype": str(self.runner.dtype),
            "load": cfg.load_format,
            "seed": cfg.seed if cfg.load_format == "dummy" else None,  # dummy weights depend on it
            "method": self.method.fingerprint(),
            "kv_store": self.runner.store,  # codes depend on the scheme, bits and seed
        }
        return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).digest()

    # -- what the method plans ----------------------------------------------------------------
    def memory_plan(self, req: Request):
        """The method's memory plan for a request (prefill = the tokens present at admission)."""
        remaining = max(0, min(req.max_new_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens))
        return self.method.memory_plan(req.num_tokens, remaining, self.config.max_num_batched_tokens)

    def _prefill_peak(self, req: Request) -> int | tuple[int, ...]:
        """Slots the request's tables hold at most while its prompt is processed: per layer in the
        per-layer layout (a windowed layer's capped at its window and a chunk), per lane in the head-major
        one, their largest otherwise."""
        rest = max(0, req.num_tokens - req.num_computed_tokens)
        if not self.kv.per_layer:
            if req.resumed:  # a chain's retained KV plus the suffix still to compute
                return req.kv_len + rest
            return max(self.memory_plan(req).prefill_peak_tokens)
        peaks = [k + rest for k in req.kv_lens] if req.resumed else self.memory_plan(req).prefill_peak_tokens
        if not req.resumed and self.kv.layout.heads > 1:  # a head-major request's lanes fill alike until compacted
            peaks = self.kv.layout.per_table(peaks)
        return self.kv.layout.window_peaks(peaks, self.config.max_num_batched_tokens, self.config.block_size)

    def _full_prefill(self, req: Request) -> bool:
        return self.method.prefill_policy is PrefillPolicy.LONG_BS1FULL_SHORT_BATCH

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        chain_id: str | None = None,
        chain_append_start: int | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input.

        ``chain_id``: continue (or create) that chain: when the prompt extends the chain's processed
        tokens, their retained KV is reused and only the rest is computed. ``chain_append_start``:
        the prompt holds only what follows the chain's first ``chain_append_start`` tokens. Chain
        problems raise ``sparse_cache.ChainError`` subclasses (a ValueError), queuing nothing.
        """
        params = sampling_params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        if chain_id is not None:
            token_ids = self.chains.logical_prompt(chain_id, chain_append_start, token_ids)
        elif chain_append_start is not None:
            raise ValueError("chain_append_start needs a chain_id")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this model has none")
        lens = [0] * self.kv.layout.num_lens  # per layer, or per lane (head-major)
        req = Request(request_id, token_ids, params, arrival=self.num_steps, prompt=text, kv_lens=lens)
        if chain_id is not None:
            req.chain_id = chain_id
            self.chains.open(req)  # last check that can fail: nothing to undo before it
        self._requests[request_id] = req
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(token_ids)
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                params.stop,
                include_stop=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            )
        self.scheduler.add(req)
        return request_id

    def add_synthetic_request(
        self, num_prompt_tokens: int, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Benchmarks only: a request of ``num_prompt_tokens`` random token ids whose prompt counts as
        prefilled, holding the KV slots its method keeps after prefill (``memory_plan``'s resident
        tokens), with whatever values the pool holds (``runner.randomize_kv()`` fills it with noise).

        The first step computes the last prompt token as a decode and samples the first output token, so
        128K-context decode can be measured without hours of prefill. Raises ValueError when it does not
        fit the pool now.
        """
        params = sampling_params or SamplingParams()
        if not 2 <= num_prompt_tokens < self.max_model_len:
            raise ValueError(f"num_prompt_tokens must be in [2, max_model_len={self.max_model_len})")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        g = torch.Generator().manual_seed(zlib.crc32(str(request_id).encode()))  # the same on every rank
        token_ids = torch.randint(0, self.runner.model_config.vocab_size, (num_prompt_tokens,), generator=g).tolist()
        req = Request(request_id, token_ids, params, arrival=self.num_steps, kv_lens=[0] * self.kv.layout.num_lens)
        resident = self.memory_plan(req).resident_tokens
        if self.kv.layout.heads > 1:  # every lane of a layer holds its planned (average) count
            resident = self.kv.layout.per_table(resident)
        req.kv_lens = [n - 1 for n in resident]
        if self.kv.allocate_computed(request_id, resident, req.kv_lens) is None:
            free, total = self.kv.num_free_blocks, self.kv.num_blocks
            why = f"a synthetic request holding {max(resident)} tokens does not fit the KV pool now"
            why += f" ({free} of its {total} blocks free)"
            arena = self.method.cluster_arena
            if arena is not None:  # reserved before the pool, for max_num_seqs requests of max_model_len
                why += (
                    f"; the cluster index arena holds {arena.nbytes / 2**30:.1f} GiB for max_num_seqs="
                    f"{self.config.max_num_seqs} requests of up to max_model_len tokens: lower max_num_seqs"
                )
            raise ValueError(why)
        req.num_computed_tokens = req.prefill_len = num_prompt_tokens
        req.num_computed_tokens -= 1
        req.status = RequestStatus.RUNNING
        self._requests[request_id] = req
        self.scheduler.running.append(req)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json; pass token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.runner.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return None, token_ids

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and not req.is_finished:
            self._unlaunch(req)
            self._finish(req, "abort")
            self._forget(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an update for every request that produced output or finished."""
        if self._stashed:
            outputs, self._stashed = self._stashed, []
            return outputs
        if not self.async_scheduling:
            launched = self._launch()
            return [] if launched is None else self._complete(launched)
        cur, self._inflight = self._inflight, None
        if cur is None:
            cur = self._launch()
            if cur is None:
                return []
            if not cur.pipelined:
                return self._complete(cur)
            self._advance_all(cur)
        elif not cur.pipelined:
            return self._resolve(cur)  # its bookkeeping was done when it was launched
        # Step N = cur runs on the device: schedule and launch N+1, then take N's tokens.
        ending = self._hold_places(cur)
        nxt = self._launch(exclude=ending, previous=cur)
        self.num_pipelined_steps += nxt is not None
        outputs = self._resolve(cur)
        if nxt is not None:
            self._advance_all(nxt)
            if not all(req.is_finished for req, _ in nxt.batch.items):
                self._inflight = nxt  # else every row was dropped: nothing to take from it
        return outputs

    def _launch(self, exclude: Collection[Request] = (), previous: _LaunchedStep | None = None) -> _LaunchedStep | None:
        """Schedule a step and queue it on the device; None when nothing can run. ``previous``: the
        step still running whose sampled tokens are placeholders in this one (fed on the device)."""
        batch = self.scheduler.schedule(exclude) if exclude else self.scheduler.schedule()
        for req in batch.preempted:
            self.method.release(req.request_id)
            self.runner.release(req.request_id)
        if not batch:
            if previous is None and self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            return None
        self.chains.copy_pending()  # blocks shared with a fork, copied before this step writes them
        self.chains.restore_tails([req for req, _ in batch.items])  # resumed chains' incomplete pages
        meta = build_step_metadata(
            batch,
            self.kv.table,
            self.config.block_size,
            self.kv.block_id_array,
            layout=self.kv.layout,
            block_id_arrays_of=self.kv.block_id_arrays,
        )
        feed = None if previous is None else _token_feed(batch, meta, previous)
        prompt_rows = _prompt_rows(batch, meta)
        # Queued on the device; the tokens reach the host later.
        if prompt_rows:
            pending = self.runner.run(meta, feed, prompt_rows)
            _keep_prompt_logprobs(batch, pending)
        else:
            pending = self.runner.run(meta) if feed is None else self.runner.run(meta, feed)
        compactions = self.method.finish_step()
        self.num_steps += 1
        observed = frozenset(self.runner.observed)  # what the step handed the method (prepare_step's answer)
        pipelined = self.async_scheduling and self._pipelinable(batch, meta)
        return _LaunchedStep(batch, meta, pending, compactions, pipelined, observed)

    def _pipelinable(self, batch: ScheduledBatch, meta: StepMetadata) -> bool:
        """Whether the next step may be built before this one's tokens are known: a decode-only step
        (one sampled token per request) preempting nobody and touching no chain (chains close on the
        exact tokens; a resumed chain's compaction may copy blocks shared with a fork first). What the
        next step's build needs on the host is then known without the device, whatever the method
        does: each request's KV lengths grow by one, and a compaction's new lengths are its kept counts
        (budgets, host values) and its freed blocks follow from them; the kept indices stay on the
        device and the compaction runs in stream order, after this step and before the next."""
        if batch.preempted:
            return False
        if meta.num_prefill_requests or len(meta.sampled) != meta.num_tokens:
            return False
        # penalties read the exact previous tokens
        return not any(req.chain_id is not None or req.sampling_params.penalized for req in meta.sampled)

    def _complete(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Bookkeeping and outputs of a step launched synchronously (nothing launched after it)."""
        batch, compactions = launched.batch, launched.compactions
        outputs: list[RequestOutput] = []
        if compactions:
            # A compaction may need blocks that an earlier request's finish frees: keep that order.
            sampled = self._sampled(launched)
            if self.batched_compaction:
                self._advance_many(batch.items, compactions, lambda req: self._emit(req, sampled, outputs))
                return outputs
            for req, n in batch.items:
                self._advance(req, n, compactions)
                self._emit(req, sampled, outputs)
            return outputs
        self._advance_all(launched)  # while the device still runs the step
        return self._resolve(launched)

    def _advance_all(self, launched: _LaunchedStep) -> None:
        # skipping those finished meanwhile (stopped at the step before, or aborted)
        items = [(req, n) for req, n in launched.batch.items if not req.is_finished]
        if launched.compactions and self.batched_compaction:
            self._advance_many(items, launched.compactions)
            return
        for req, n in items:
            self._advance(req, n, launched.compactions)

    def _advance_many(self, items, compactions: dict, after=None) -> None:
        """``_advance`` of each ``(req, n)`` in order (then ``after(req)``: the emit, which may finish it and
        free its blocks), the compactions applied together: one launch per layer (``_compact_many``),
        then each request's remaining bookkeeping in order. Until that launch no block may change
        hands, so the group is applied first whenever a resumed chain's compaction may copy a fork's
        blocks into fresh ones (it may need those the earlier requests free, as request by request)."""
        group: list[tuple[Request, bool | None, object]] = []

        def apply_group() -> None:
            new_lens = self._compact_many([(req, c) for req, _, c in group if c is not None])
            for req, ends_prompt, _ in group:
                if req in new_lens:  # blocks go back in the order request by request gives them back
                    req.kv_lens = new_lens[req]
                    self.kv.shrink(req.request_id, req.kv_lens)
                self._advance_rest(req, ends_prompt)
                if after is not None:
                    after(req)
            group.clear()

        for req, n in items:
            compaction = compactions.get(req.request_id)
            if compaction is not None and req.resumed:
                apply_group()
            ends_prompt = self._advance_lengths(req, n)
            if compaction is not None and not self.chains.make_writable(req, compaction):
                self._preempt_compacting(req)
                compaction = None
            group.append((req, ends_prompt, compaction))
        apply_group()

    def _hold_places(self, launched: _LaunchedStep) -> set[Request]:
        """Give the step's sampled requests a placeholder token (their next decode is scheduled on it);
        returns those the token ends by length, which the next step leaves out."""
        ending = set()
        for req in launched.meta.sampled:
            if req.is_finished:
                continue
            req.append_token(_PLACEHOLDER)
            if req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= self.max_model_len:
                ending.add(req)
        launched.placeholders = True
        return ending

    def _resolve(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Take a step's tokens (waits for the device) and emit them, skipping dropped rows."""
        sampled = self._sampled(launched)
        outputs: list[RequestOutput] = []
        for req, _ in launched.batch.items:
            if not req.is_finished:
                self._emit(req, sampled, outputs, fill=launched.placeholders)
        return outputs

    @staticmethod
    def _sampled(launched: _LaunchedStep) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Request id -> (sampled token, its log-probabilities when the request asked for them)."""
        logprobs = launched.pending.logprobs()
        tokens = launched.pending.tolist()
        return {
            r.request_id: (t, logprobs.get(i))
            for i, (r, t) in enumerate(zip(launched.meta.sampled, tokens, strict=True))
        }

    def _unlaunch(self, req: Request) -> None:
        """Undo the bookkeeping of the in-flight step for a request leaving before its tokens are
        taken (abort): its state is then the one the caller has seen, as without pipelining. A step
        that compacted or observed the request is kept instead (its KV was rewritten on the device, the
        method's state took it in): a chain then resumes from the state after it."""
        inflight = self._inflight
        if inflight is None:
            return
        kept = req.request_id in inflight.compactions or req.request_id in inflight.observed
        for r, n in inflight.batch.items:
            if r is req and not kept:
                req.num_computed_tokens -= n
                req.kv_lens = [kv_len - n for kv_len in req.kv_lens]
        if all(r.is_finished or r is req for r, _ in inflight.batch.items):
            self._inflight = None  # nothing left to take from it

    def drain(self) -> None:
        """Take the in-flight step's tokens now (their outputs come with the next ``step()``): the
        engine's state is then that of a synchronous engine (used before pruning)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._stashed += self._resolve(inflight)

    def _advance(self, req: Request, n: int, compactions: dict) -> None:
        """Account for the step's ``n`` computed tokens: KV lengths, compaction, prefix-cache blocks."""
        ends_prompt = self._advance_lengths(req, n)
        compaction = compactions.get(req.request_id)
        if compaction is not None and not self._compact(req, compaction):
            self._preempt_compacting(req)
        self._advance_rest(req, ends_prompt)

    def _advance_lengths(self, req: Request, n: int) -> bool | None:
        """The step's ``n`` tokens in the request's counts, before its compaction; returns whether they
        end its prompt (None: a replay pass, whose KV is dropped and whose request's tokens are unchanged)."""
        if req.replaying:
            req.num_replays_done += 1
            return None
        ends_prompt = req.num_computed_tokens < req.prefill_len <= req.num_computed_tokens + n
        req.num_computed_tokens += n
        req.kv_lens = [kv_len + n for kv_len in req.kv_lens]
        return ends_prompt

    def _advance_rest(self, req: Request, ends_prompt: bool | None) -> None:
        """After the request's compaction: its table's length, prefix-cache blocks, replay passes."""
        if not self.kv.has_request(req.request_id):
            return
        if ends_prompt is None:
            self.kv.shrink(req.request_id, req.kv_lens)
            return
        self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        self.kv.slide(req.request_id, req.kv_lens)  # windowed layers give back what they no longer read
        if ends_prompt:
            self._plan_replays(req)

    def _preempt_compacting(self, req: Request) -> None:
        """No blocks to copy a fork's shared blocks into: recompute this one later instead."""
        self.scheduler.preempt(req)
        self.method.release(req.request_id)
        self.runner.release(req.request_id)

    def _plan_replays(self, req: Request) -> None:
        """Ask the method for its replay passes of the prompt just processed, as token ids."""
        passes = self.method.replay_passes(req.request_id, req.token_ids[: req.prefill_len])
        planned = []
        for p in passes:
            ids: list[int] = []
            for part in p.parts:
                if isinstance(part, str):
                    if self.tokenizer is None:
                        raise ValueError(f"{self.method.name}'s replay passes need a tokenizer; this model has none")
                    ids += self.tokenizer.encode(part, add_special_tokens=False)
                else:
                    ids += part
            if not 2 <= len(ids) <= self.config.max_num_batched_tokens:
                raise ValueError(
                    f"a replay pass of {len(ids)} tokens must have 2 to max_num_batched_tokens "
                    f"({self.config.max_num_batched_tokens}) tokens"
                )
            planned.append(tuple(ids))
        req.replay_passes, req.num_replays_done = tuple(planned), 0

    def _emit(self, req: Request, sampled: dict, outputs: list[RequestOutput], fill: bool = False) -> None:
        entry = sampled.get(req.request_id)
        if entry is None:
            return
        try:
            outputs.append(self._append_token(req, entry[0], fill, entry[1]))
        except Exception as e:  # this request's own postprocessing (detokenizer, stop checks) failed: it alone ends
            logger.exception("request %s failed; the engine goes on", req.request_id)
            outputs.append(self._fail(req, e))

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        if not req.is_finished:
            self._finish(req, "error")
        out = replace(self._output(req, (), ""), error=f"{type(error).__name__}: {error}")
        self._forget(req)
        return out

    def _compact(self, req: Request, compaction) -> bool:
        """Move the kept KV to the front of each layer and give whole free blocks back to the pool.
        False (nothing changed) when blocks shared with a fork cannot be copied first."""
        if not self.chains.make_writable(req, compaction):
            return False
        rid, bs = req.request_id, self.config.block_size
        if self.kv.layout.heads > 1:  # ragged per-head counts, each (layer, KV head) lane compacted alone
            req.kv_lens = apply_lane_compaction(self.runner.kv, self._tables(req), req.kv_lens, compaction, bs)
        else:
            tail = self._tail_row(req)
            req.kv_lens = apply_compaction(self.runner.kv, self._tables(req), req.kv_lens, compaction, bs, tail)
        self.kv.shrink(rid, req.kv_lens)
        return True

    def _compact_many(self, staged: list[tuple[Request, object]]) -> dict[Request, list[int]]:
        """The KV moves of ``_compact`` for requests made writable already, in one ``compact_kv`` launch
        per layer; returns their new KV lengths (the caller shrinks their tables)."""
        if self.kv.layout.heads > 1:  # head-major lanes: request by request
            new_lens = [
                apply_lane_compaction(self.runner.kv, self._tables(r), r.kv_lens, c, self.config.block_size)
                for r, c in staged
            ]
        else:
            requests = [(self._tables(r), r.kv_lens, c) for r, c in staged]
            tails = [self._tail_row(r) for r, _ in staged]
            new_lens = apply_compactions(self.runner.kv, requests, self.config.block_size, tails)
        return {req: lens for (req, _), lens in zip(staged, new_lens, strict=True)}

    def _tail_row(self, req: Request) -> int | None:
        """The request's row of the store's full-precision tail (KIVI's incomplete page), if the store has one."""
        return None if self.runner.tail_rows is None else self.runner.tail_rows.row(req.request_id)

    def _tables(self, req: Request) -> list:
        """The request's block ids per KV length it keeps (per layer, or per (layer, KV head) lane)."""
        return [self.kv.table(req.request_id, t).block_ids for t in range(len(req.kv_lens))]

    def _append_token(
        self, req: Request, token: int, fill: bool = False, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        if fill:  # the placeholder the next step was scheduled on
            req.token_ids[-1] = token
        else:
            req.append_token(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        params = req.sampling_params
        delta_text, stop_str = "", None
        detok = self._detok.get(req.request_id)
        if detok is not None:
            delta_text, stop_str = detok.add(token)
        if token in params.stop_token_ids:
            self._finish(req, "stop", token)
        elif token in self.eos_token_ids and not params.ignore_eos:
            self._finish(req, "stop", token)
        elif stop_str is not None:
            self._finish(req, "stop", stop_str)
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, "length")
        out = self._output(req, (token,), delta_text)
        if req.is_finished:
            self._forget(req)
        return out

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        state = self.method.release(req.request_id)
        self.chains.close(req, state)  # the chain takes the request's KV before the scheduler would free it
        self.scheduler.finish(req, reason)
        self.runner.release(req.request_id)
        req.stop_reason = stop_reason
        self.runner.sampler.release(req.request_id)

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)

    def _output(self, req: Request, delta_ids: tuple[int, ...], delta_text: str) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=tuple(req.output_token_ids),
            text=detok.text if detok else "",
            delta_token_ids=delta_ids,
            delta_text=delta_text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_prompt_tokens,
            chain_id=req.chain_id,
            chain_status=req.chain_status,
            reused_tokens=req.num_reused_tokens,
            logprobs=None if req.sampling_params.logprobs is None else tuple(req.logprobs),
            prompt_logprobs=None if req.prompt_logprobs is None else tuple(req.prompt_logprobs),
        )

    # -- chains and pruning ---------------------------------------------------------------------
    def fork_chain(self, chain_id: str, new_chain_id: str | None = None) -> str:
        """A new chain sharing ``chain_id``'s retained KV copy-on-write; returns its id (generated when
        not given). The source must be idle."""
        return self.kv.chains.fork(chain_id, new_chain_id)

    def drop_chain(self, chain_id: str) -> None:
        """Forget an idle chain and free its KV."""
        self.kv.chains.drop(chain_id)

    def chain_info(self, chain_id: str) -> ChainInfo:
        return self.kv.chains.info(chain_id)

    def prune(
        self,
        prompt: str | list[int],
        ranges,
        keep_tokens: int,
        *,
        policy: str = "snapkv_global",
        observation_window_size: int = 32,
        kvzip_score_chunk_size: int = 2048,
        kvzip_prev_postfix_size: int = 64,
        chain_id: str | None = None,
    ) -> PruneResult:
        """Compress token ranges of the cached history ``prompt`` into a new degraded chain (see
        ``prune.prune_history``); resume it by naming its ``chain_id`` in the next request."""
        _, token_ids = self._tokenize(prompt)
        self.drain()
        return prune_history(
            self,
            token_ids,
            ranges,
            keep_tokens,
            policy=policy,
            window=observation_window_size,
            kvzip_score_chunk_size=kvzip_score_chunk_size,
            kvzip_prev_postfix_size=kvzip_prev_postfix_size,
            chain_id=chain_id,
        )

    # -- stats ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def prefix_hit_tokens(self) -> int:
        return self.kv.prefix_hit_tokens


def _token_feed(batch: ScheduledBatch, meta: StepMetadata, previous: _LaunchedStep) -> TokenFeed:
    """Rows of ``meta`` whose last token is a placeholder for a token ``previous`` sampled."""
    source = {id(req): j for j, req in enumerate(previous.meta.sampled)}
    rows, sources = [], []
    for (req, n), start in zip(batch.items, meta.row_starts, strict=True):
        j = source.get(id(req))
        if j is not None and req.token_ids[-1] == _PLACEHOLDER and req.num_computed_tokens + n == req.num_tokens:
            rows.append(start + n - 1)
            sources.append(j)
    return TokenFeed(previous.pending.device_tokens, rows, sources)


def _prompt_rows(batch: ScheduledBatch, meta: StepMetadata) -> tuple[PromptRows, ...]:
    """The step's rows whose following prompt token a request wants the log-probability of."""
    rows = []
    for (req, n), start in zip(batch.items, meta.row_starts, strict=True):
        k = req.sampling_params.prompt_logprobs
        first = req.num_computed_tokens
        if k is None or first + 1 >= req.num_prompt_tokens:
            continue
        targets = tuple(req.token_ids[first + 1 : min(first + n + 1, req.num_prompt_tokens)])
        rows.append(PromptRows(req.request_id, start, first, targets, k))
    return tuple(rows)


def _keep_prompt_logprobs(batch: ScheduledBatch, pending: SampledTokens) -> None:
    for req, _ in batch.items:
        for position, logprobs in pending.prompt_logprobs.get(req.request_id, {}).items():
            req.prompt_logprobs[position] = logprobs


def check_before_start(config: EngineConfig) -> None:
    """The engine's checks that need only the config and the model's ``config.json`` (the model's limit, the
    method's support for tensor parallelism, the method's parameters and page size), without loading weights:
    ``tensor_parallel.MirroredEngine`` makes them before it starts any rank (each rank's engine makes them again,
    over its own KV heads)."""
    model_cfg = _checked_model_config(config)
    _check_split_heads(config)
    _checked_method(config, model_cfg)


def _checked_model_config(config: EngineConfig) -> ModelConfig:
    model_cfg = read_model_config(config.model)
    model_max_len = model_cfg.max_position_embeddings  # sliding windows are applied in the kernels
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {model_max_len} tokens")
    return model_cfg


def _checked_method(config: EngineConfig, model_cfg: ModelConfig) -> sparse_methods.SparseMethod:
    """The configured method over this rank's KV heads (all of them on one rank, or before ranks start)."""
    heads = rank_attention_config(model_cfg)
    group = model_cfg.num_attention_heads // model_cfg.num_key_value_heads
    method = build_method(
        config.sparse_method,
        # The method sees this rank's KV heads and their whole query groups (see PagedAttention).
        ModelShape(
            model_cfg.num_hidden_layers,
            heads.num_key_value_heads * group,
            heads.num_key_value_heads,
            model_cfg.head_dim,
            frozenset(layer for layer, w in enumerate(model_cfg.layer_sliding_windows) if w is not None),
        ),
        config.prefill_sparse_method,
        **config.method_params(),
    )
    method.head_reduction = head_reduction(model_cfg.num_key_value_heads)  # spans this rank's shard
    _check_page_tokens(method, config)
    return method


def _check_page_tokens(method, config: EngineConfig) -> None:
    """A method whose pages assume a block size (``Storage.page_tokens``) runs only with that block size."""
    page = method.storage.page_tokens
    if page is not None and page != config.block_size:
        how = f"kv_quant_page_size={page}" if config.resolved_kv_cache_dtype() == "kivi" else f"block_size={page}"
        raise ValueError(
            f"{method.name} works on pages of {page} tokens; the engine's blocks hold {config.block_size} (set {how})"
        )


def _check_tensor_parallel(config: EngineConfig) -> None:
    """The process group matches ``tensor_parallel_size`` and the method runs with split heads."""
    if tp_world_size() != config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} but this process is one of {tp_world_size()} ranks; "
            "start tensor-parallel engines through LLM(...) or sparse_serve.tensor_parallel.launch_engine"
        )
    _check_split_heads(config)


def _check_split_heads(config: EngineConfig) -> None:
    """The method runs with split heads (``Support.TENSOR_PARALLEL``) if ``tensor_parallel_size > 1``."""
    method = sparse_methods.get_method_class(config.sparse_method)
    if config.tensor_parallel_size > 1 and Support.TENSOR_PARALLEL not in method.supports:
        raise ValueError(f"{config.sparse_method} does not support tensor_parallel_size > 1 yet")


def _load_tokenizer(path: str, extra_eos) -> Tokenizer | None:
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_pretrained(path, extra_eos)
