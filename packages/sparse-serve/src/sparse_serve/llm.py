"""Offline generation: ``LLM(model, **config).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm import tqdm

from sparse_cache import ChainInfo
from sparse_serve.config import EngineConfig
from sparse_serve.outputs import RequestOutput
from sparse_serve.prune import PruneResult
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.tensor_parallel import launch_engine

Prompt = str | list[int]
ChainIds = str | Sequence[str | None] | None
AppendStarts = int | Sequence[int | None] | None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(value, n: int, name: str) -> list:
    """One value per prompt: None for all, a scalar for a single prompt, or a sequence of ``n``."""
    if value is None:
        return [None] * n
    if isinstance(value, (str, int)):
        if n != 1:
            raise ValueError(f"one {name} for {n} prompts; pass one per prompt (a chain takes one writer at a time)")
        return [value]
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{len(values)} {name} values for {n} prompts")
    return values


class LLM:
    """An engine plus the convenience of batch generation and streaming.

    Parameters
    ----------
    model : path to an HF-format model folder.
    **config : any ``EngineConfig`` field (``block_size``, ``max_num_batched_tokens``, ...);
        unknown names raise a validation error.

    Chains: ``generate(..., chain_id=...)`` continues a conversation from its retained KV (see
    ``LLMEngine.add_request``); ``fork_chain``, ``drop_chain`` and ``prune`` manage chains.
    """

    def __init__(self, model: str, **config):
        # tensor_parallel_size > 1: this process is rank 0 and starts the others (closed by ``close``).
        self.engine = launch_engine(EngineConfig(model=model, **config))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts, sampling_params, chain_id: ChainIds = None, chain_append_start=None) -> list[str]:
        prompt_list = _as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("no prompts given")
        chains = _per_prompt(chain_id, len(prompt_list), "chain_id")
        starts = _per_prompt(chain_append_start, len(prompt_list), "chain_append_start")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(params)} sampling params for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, chain, start in zip(prompt_list, params, chains, starts, strict=True):
                ids.append(self.engine.add_request(prompt, p, chain_id=chain, chain_append_start=start))
        except Exception:
            for rid in ids:  # a bad prompt rejects the whole call; leave nothing queued
                self.engine.abort_request(rid)
            raise
        return ids

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chain_id: ChainIds = None,
        chain_append_start: AppendStarts = None,
    ) -> Iterator[RequestOutput]:
        """Yield an update per request per step as tokens arrive (``delta_text``, ``delta_token_ids``)."""
        ids = set(self._add_all(prompts, sampling_params, chain_id, chain_append_start))
        try:
            while ids:
                for out in self.engine.step():
                    if out.request_id in ids:
                        if out.finished:
                            ids.discard(out.request_id)
                        yield out
        finally:
            for rid in ids:  # the consumer stopped early: free what is still running
                self.engine.abort_request(rid)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chain_id: ChainIds = None,
        chain_append_start: AppendStarts = None,
    ) -> list[RequestOutput]:
        """Generate to completion; outputs are in prompt order. ``use_tqdm`` shows a progress bar.

        ``chain_id`` (one per prompt, or one for a single prompt) continues or creates that chain;
        ``chain_append_start``: the prompt holds only what follows that many of the chain's tokens.
        """
        ids = self._add_all(prompts, sampling_params, chain_id, chain_append_start)
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[order[out.request_id]] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        finally:
            bar.close()
            for rid in pending:  # interrupted (e.g. KeyboardInterrupt): free what is still running
                self.engine.abort_request(rid)
        return results  # type: ignore[return-value]

    # -- chains and pruning ---------------------------------------------------------------------
    def fork_chain(self, chain_id: str, new_chain_id: str | None = None) -> str:
        """Branch an idle chain: the new one shares its retained KV copy-on-write. Returns the new id."""
        return self.engine.fork_chain(chain_id, new_chain_id)

    def drop_chain(self, chain_id: str) -> None:
        """Forget an idle chain and free its KV."""
        self.engine.drop_chain(chain_id)

    def chain_info(self, chain_id: str) -> ChainInfo:
        """Processed tokens, retained KV per layer, blocks, busy and degraded flags of a chain."""
        return self.engine.chain_info(chain_id)

    def prune(
        self,
        prompt: Prompt,
        ranges: Sequence[tuple[int, int]],
        keep_tokens: int,
        *,
        policy: str = "snapkv_global",
        observation_window_size: int = 32,
        kvzip_score_chunk_size: int = 2048,
        kvzip_prev_postfix_size: int = 64,
        chain_id: str | None = None,
    ) -> PruneResult:
        """Compress ``ranges`` of the cached history ``prompt`` into a new degraded chain (``chain_id``,
        generated when None) that a later request resumes by naming it. ``policy="snapkv_global"`` keeps
        ``keep_tokens`` tokens in each range (scored by the ``observation_window_size`` queries after
        it); ``"kvzip_global"`` keeps ``keep_tokens`` in all ranges together (scored by replays of
        ``kvzip_score_chunk_size`` tokens, each after ``kvzip_prev_postfix_size`` tokens before it)."""
        return self.engine.prune(
            prompt,
            ranges,
            keep_tokens,
            policy=policy,
            observation_window_size=observation_window_size,
            kvzip_score_chunk_size=kvzip_score_chunk_size,
            kvzip_prev_postfix_size=kvzip_prev_postfix_size,
            chain_id=chain_id,
        )
