"""Offline generation: ``LLM(model, **config).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm import tqdm

from sparse_serve.config import EngineConfig
from sparse_serve.engine import LLMEngine
from sparse_serve.outputs import RequestOutput
from sparse_serve.sampling_params import SamplingParams

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    """An engine plus the convenience of batch generation and streaming.

    Parameters
    ----------
    model : path to an HF-format model folder.
    **config : any ``EngineConfig`` field (``block_size``, ``max_num_batched_tokens``, ...);
        unknown names raise a validation error.
    """

    def __init__(self, model: str, **config):
        self.engine = LLMEngine(EngineConfig(model=model, **config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts, sampling_params) -> list[str]:
        prompt_list = _as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(params)} sampling params for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompt_list, params, strict=True):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:  # a bad prompt rejects the whole call; leave nothing queued
                self.engine.abort_request(rid)
            raise
        return ids

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield an update per request per step as tokens arrive (``delta_text``, ``delta_token_ids``)."""
        ids = set(self._add_all(prompts, sampling_params))
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
    ) -> list[RequestOutput]:
        """Generate to completion; outputs are in prompt order. ``use_tqdm`` shows a progress bar."""
        ids = self._add_all(prompts, sampling_params)
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
