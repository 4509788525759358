"""Response bodies in OpenAI's shapes, built from the engine's ``RequestOutput``.

Plain dicts rather than pydantic models: a stream builds one per token per request, and the
shapes are fixed by OpenAI's API reference (completions, chat completions, their chunk objects).
A streamed update becomes one chunk even when its text is empty (a token that completes no
character yet), so clients see every token's timing.

Chain extension: ``usage.reused_tokens`` counts the prompt tokens resumed from a chain's retained KV
(0 off chains), and a request on a chain gets ``chain_id`` and ``chain_status`` (``created``,
``resumed`` or ``recreated``) beside ``usage`` in its response, its last content chunk and its
usage chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from sparse_serve.outputs import RequestOutput

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON body."""
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "reused_tokens": out.reused_tokens,
    }


def chain_fields(out: RequestOutput) -> dict[str, Any]:
    """``chain_id`` and ``chain_status`` of a request on a chain (empty otherwise)."""
    if out.chain_id is None:
        return {}
    return {"chain_id": out.chain_id, "chain_status": out.chain_status}


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


class CompletionReply:
    """Bodies of one ``/v1/completions`` request: the response, or its stream of chunks."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def _choice_delta(self, out: RequestOutput) -> dict[str, Any]:
        return {"index": 0, "text": out.delta_text, "logprobs": None, "finish_reason": _finish_reason(out)}

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        body = {**self._base(self.chunk_object), "choices": [self._choice_delta(out)], "usage": None}
        return {**body, **chain_fields(out)} if out.finished else body

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The final chunk of a stream asked for with ``stream_options.include_usage``."""
        return {**self._base(self.chunk_object), "choices": [], "usage": usage(out), **chain_fields(out)}

    def _choice(self, out: RequestOutput) -> dict[str, Any]:
        return {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}

    def response(self, out: RequestOutput) -> dict[str, Any]:
        # stop_reason (an extension, as in vLLM): the stop string or token id that ended generation.
        choice = {**self._choice(out), "stop_reason": out.stop_reason}
        body = {**self._base(self.object), "choices": [choice], "usage": usage(out), "system_fingerprint": None}
        return {**body, **chain_fields(out)}


class ChatReply(CompletionReply):
    """Bodies of one ``/v1/chat/completions`` request."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening_chunks(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self._base(self.chunk_object), "choices": [choice], "usage": None}]

    def _choice_delta(self, out: RequestOutput) -> dict[str, Any]:
        delta = {"content": out.delta_text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish_reason(out)}

    def _choice(self, out: RequestOutput) -> dict[str, Any]:
        message = {"role": "assistant", "content": out.text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason}
