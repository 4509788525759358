"""The chain cache over HTTP: fork, drop, inspect and prune-into chains (engine extensions).

Routes (JSON bodies validated as strictly as the OpenAI ones; errors in OpenAI's shape):

- ``POST /v1/chains/fork`` ``{"chain_id", "new_chain_id"?}``: a new chain sharing the idle source's
  retained KV copy-on-write (``LLMEngine.fork_chain``); answers the new chain's info.
- ``GET /v1/chains/{chain_id}``: the chain's info (``LLMEngine.chain_info``).
- ``DELETE /v1/chains/{chain_id}``: forget an idle chain and free its KV (``LLMEngine.drop_chain``).
- ``POST /v1/chains/prune`` ``{"prompt", "ranges", "keep_tokens", "policy"?, "observation_window_size"?,
  "kvzip_score_chunk_size"?, "kvzip_prev_postfix_size"?, "chain_id"?}``: compress ranges of the cached
  history ``prompt`` into a new degraded chain (``LLMEngine.prune``); answers its info and the
  positions kept in each range.

Every engine call runs where the engine runs (``AsyncEngine.call`` / ``EngineProcess.call``), between
steps; the functions are module-level so that they can cross to an engine process. Chain errors keep
their code: an unknown chain is a 404, a busy one (checked out by a running request) a 409, and
the others (``chain_exists``, ``chain_capacity``...) 400s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from sparse_cache import ChainInfo, check_ranges
from sparse_serve.prune import PRUNE_POLICIES
from sparse_serve.server.async_engine import EngineUnavailableError
from sparse_serve.server.errors import bad_request, from_engine_error, server_error
from sparse_serve.server.generation import encode
from sparse_serve.server.protocol import StrictBody, parse_body, unknown_model

if TYPE_CHECKING:
    from sparse_serve.server.generation import State as _State

router = APIRouter(prefix="/v1/chains")


class _ChainBody(StrictBody):
    model: str | None = None  # optional: when given, it must name the served model


class ForkChainRequest(_ChainBody):
    chain_id: str = Field(min_length=1)
    new_chain_id: str | None = Field(None, min_length=1)  # generated when left out


class PruneRequest(_ChainBody):
    prompt: str | list[int]  # the cached history (snapkv_global: then at least one token after the last range)
    ranges: list[tuple[int, int]] = Field(min_length=1)  # [start, end) token positions, ascending
    keep_tokens: int = Field(ge=0)  # kept per range, kvzip_global: in all ranges (0 drops the ranges' KV)
    policy: Literal[PRUNE_POLICIES] = "snapkv_global"  # type: ignore[valid-type]
    observation_window_size: int = Field(32, ge=1)  # snapkv_global
    kvzip_score_chunk_size: int = Field(2048, ge=1)  # kvzip_global
    kvzip_prev_postfix_size: int = Field(64, ge=0)  # kvzip_global
    chain_id: str | None = Field(None, min_length=1)  # the new chain's id, generated when left out


def chain_json(info: ChainInfo) -> dict[str, Any]:
    """A chain's info: ``num_tokens`` whose KV was computed, ``kv_lens`` retained slots per layer
    (empty once evicted: the next turn recomputes), ``num_retained_tokens`` their most over layers."""
    return {
        "object": "chain",
        "chain_id": info.chain_id,
        "num_tokens": info.num_tokens,
        "num_retained_tokens": max(info.kv_lens, default=0),
        "kv_lens": list(info.kv_lens),
        "num_blocks": info.num_blocks,
        "busy": info.busy,
        "degraded": info.degraded,
    }


@router.post("/fork")
async def fork_chain(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = await _parse(request, ForkChainRequest, state)
    info = await _call(
        state,
        _fork,
        body.chain_id,
        body.new_chain_id,
        code_params={"chain_exists": "new_chain_id"},  # only the new id can be taken already
    )
    return chain_json(info)


def _fork(engine, chain_id: str, new_chain_id: str | None) -> ChainInfo:
    return engine.chain_info(engine.fork_chain(chain_id, new_chain_id))


def _info(engine, chain_id: str) -> ChainInfo:
    return engine.chain_info(chain_id)


def _drop(engine, chain_id: str) -> None:
    engine.drop_chain(chain_id)


@router.get("/{chain_id:path}")
async def chain_info(chain_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    return chain_json(await _call(state, _info, chain_id))


@router.delete("/{chain_id:path}")
async def drop_chain(chain_id: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    await _call(state, _drop, chain_id)
    return {"object": "chain", "chain_id": chain_id, "deleted": True}


@router.post("/prune")
async def prune(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = await _parse(request, PruneRequest, state)
    token_ids = await _prompt_ids(state, body.prompt)
    try:  # the ranges' shape, checked here to name the field; the engine checks them against the cache
        check_ranges(body.ranges, len(token_ids))
    except ValueError as e:
        raise bad_request(str(e), param="ranges", code="invalid_value") from None
    if body.policy == "snapkv_global" and body.ranges[-1][1] >= len(token_ids):
        raise bad_request("the prompt needs at least one token after the last range", param="ranges")

    fields = body.model_dump(exclude={"model", "prompt"})
    return await _call(state, _prune, token_ids, fields)


def _prune(engine, token_ids: list[int], fields: dict[str, Any]) -> dict[str, Any]:
    result = engine.prune(token_ids, **fields)
    info = chain_json(engine.chain_info(result.chain_id))
    return {**info, "num_retained_tokens": result.num_retained_tokens, "kept": [list(k) for k in result.kept]}


# -- helpers --------------------------------------------------------------------------------------
def _state(request: Request) -> _State:
    return request.app.state.server


async def _parse(request: Request, model, state: _State):
    body = await parse_body(request, model, state.max_body_bytes)
    if body.model is not None and body.model not in state.model_names:
        raise unknown_model(body.model)
    return body


async def _prompt_ids(state: _State, prompt: str | list[int]) -> list[int]:
    """Token ids of a prompt (text is encoded as ``/v1/completions`` encodes it: with special tokens,
    bounded in length before it is tokenized)."""
    if not prompt:
        raise bad_request("The prompt is empty.", param="prompt")
    if isinstance(prompt, list):
        return prompt
    return await encode(state, prompt, add_special_tokens=True, param="prompt")


async def _call(state: _State, fn, *args, code_params: dict[str, str] | None = None):
    """``fn(engine, *args)`` where the engine runs; its ValueErrors become 4xx answers (a chain error's
    ``param`` is ``chain_id`` unless ``code_params`` names another for its code)."""
    try:
        return await state.engine.call(fn, *args)
    except EngineUnavailableError as e:
        raise server_error(503, str(e), code="engine_unavailable") from None
    except ValueError as e:
        chain_param = (code_params or {}).get(getattr(e, "code", None), "chain_id")
        raise from_engine_error(e, chain_param=chain_param) from None
