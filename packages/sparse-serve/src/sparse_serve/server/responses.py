"""Response bodies in OpenAI's shapes, built from the engine's ``RequestOutput``.

Plain dicts rather than pydantic models: a stream builds one per token per request, and the
shapes are fixed by OpenAI's API reference (completions, chat completions, their chunk objects).
A streamed update becomes one chunk even when its text is empty (a token that completes no
character yet), so clients see every token's timing. A request with several prompts or ``n > 1``
has one choice per (prompt, sample), ``index = prompt_index * n + sample``.

Log-probabilities: completions use the legacy shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as token -> logprob maps, ``text_offset``), with the prompt's tokens first under
``echo`` (its first token has none); chat uses ``content: [{token, logprob, bytes, top_logprobs}]``.

Chain extension: ``usage.reused_tokens`` counts the prompt tokens resumed from a chain's retained KV
(0 off chains), and a request on a chain gets ``chain_id`` and ``chain_status`` (``created``,
``resumed`` or ``recreated``) beside ``usage`` in its response, its last content chunk and its
usage chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sparse_serve.outputs import RequestOutput
from sparse_serve.sampler import TokenLogprobs

DONE_EVENT = b"data: [DONE]\n\n"
TokenText = Callable[[int], str]  # a token id's own text (special tokens included)


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON body."""
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(outs: Sequence[RequestOutput], num_prompts: int = 1) -> dict[str, Any]:
    """Token counts of a request's choices (``num_prompts`` distinct prompts: each counted once)."""
    n = max(1, len(outs) // max(num_prompts, 1))
    firsts = outs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
        "reused_tokens": sum(o.reused_tokens for o in firsts),
    }


def chain_fields(out: RequestOutput) -> dict[str, Any]:
    """``chain_id`` and ``chain_status`` of a request on a chain (empty otherwise)."""
    if out.chain_id is None:
        return {}
    return {"chain_id": out.chain_id, "chain_status": out.chain_status}


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


class CompletionReply:
    """Bodies of one ``/v1/completions`` request: the response, or its stream of chunks.

    ``token_text``: renders token ids for logprobs (None: the request asked for none). ``echo``:
    choices start with their prompt text and, with logprobs, the prompt's log-probabilities.
    """

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self, model: str, token_text: TokenText | None = None, echo: bool = False, prompt_texts=(), n: int = 1
    ):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.echo = echo
        self.prompt_texts = tuple(prompt_texts)  # what ``echo`` puts before each prompt's choices
        self.n = n

    def _echo_text(self, index: int) -> str:
        return self.prompt_texts[index // self.n] if self.echo else ""

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return []

    # -- logprobs -------------------------------------------------------------------------------
    def _top(self, entry: TokenLogprobs) -> dict[str, float]:
        return {self.token_text(t): lp for t, lp in entry.top} | {self.token_text(entry.token_id): entry.logprob}

    def _logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], offset: int = 0):
        """The legacy completions shape for ``token_ids`` (``entries[i]`` None: no logprob, the first prompt
        token); ``offset``: characters of text before the first token."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else self._top(e) for e in entries],
            "text_offset": offsets,
        }

    def _choice_logprobs(self, out: RequestOutput, delta: bool) -> dict[str, Any] | None:
        if self.token_text is None or out.logprobs is None:
            return None
        ids = out.delta_token_ids if delta else out.token_ids
        entries = out.logprobs[len(out.logprobs) - len(ids) :] if delta else out.logprobs
        if self.echo and not delta and out.prompt_logprobs is not None:
            ids = (*out.prompt_token_ids, *ids)
            entries = (*out.prompt_logprobs, *entries)
        return self._logprobs(ids, entries)

    # -- bodies ---------------------------------------------------------------------------------
    def _choice_delta(self, index: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        text = out.delta_text
        logprobs = self._choice_logprobs(out, delta=True)
        if first and self.echo:  # the prompt goes out with the first chunk of its choice
            text = self._echo_text(index) + text
            if logprobs is not None and out.prompt_logprobs is not None:
                echoed = self._logprobs(out.prompt_token_ids, out.prompt_logprobs)
                logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(out)}
        return {**choice, "stop_reason": out.stop_reason} if out.finished else choice

    def chunk(
        self, index: int, out: RequestOutput, first: bool = False, running_usage: dict | None = None
    ) -> dict[str, Any]:
        body = {**self._base(self.chunk_object), "choices": [self._choice_delta(index, out, first)]}
        body["usage"] = running_usage
        return {**body, **chain_fields(out)} if out.finished else body

    def usage_chunk(self, outs: Sequence[RequestOutput], num_prompts: int = 1) -> dict[str, Any]:
        """The final chunk of a stream asked for with ``stream_options.include_usage``."""
        return {
            **self._base(self.chunk_object),
            "choices": [],
            "usage": usage(outs, num_prompts),
            **chain_fields(outs[0]),
        }

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        text = self._echo_text(index) + out.text
        logprobs = self._choice_logprobs(out, delta=False)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}

    def response(self, outs: Sequence[RequestOutput], num_prompts: int = 1) -> dict[str, Any]:
        # stop_reason (an extension, as in vLLM): the stop string or token id that ended generation.
        choices = [{**self._choice(i, out), "stop_reason": out.stop_reason} for i, out in enumerate(outs)]
        body = {
            **self._base(self.object),
            "choices": choices,
            "usage": usage(outs, num_prompts),
            "system_fingerprint": None,
        }
        return {**body, **chain_fields(outs[0])}


class ChatReply(CompletionReply):
    """Bodies of one ``/v1/chat/completions`` request."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(num_choices)
        ]
        return [{**self._base(self.chunk_object), "choices": choices, "usage": None}]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _choice_logprobs(self, out: RequestOutput, delta: bool) -> dict[str, Any] | None:
        if self.token_text is None or out.logprobs is None:
            return None
        entries = out.logprobs[len(out.logprobs) - len(out.delta_token_ids) :] if delta else out.logprobs
        content = [
            {**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}

    def _choice_delta(self, index: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        delta = {"content": out.delta_text}
        logprobs = self._choice_logprobs(out, delta=True)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": _finish_reason(out)}

    def _choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        message = {"role": "assistant", "content": out.text, "refusal": None}
        logprobs = self._choice_logprobs(out, delta=False)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": out.finish_reason}
