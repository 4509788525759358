"""Count what one compressed SnapKV chain turn costs on the host, on CPU: device ops ("launches") and
host syncs, per region, per compressed request.

A tiny Qwen3 of 36 layers with the 8B's head layout (32 query heads, 8 KV heads; hidden 64, head_dim
16) runs two SnapKV chain turns in bf16 (as on the GPU: the scores convert to float32); each turn
compresses once (budget 240). Every aten op dispatched while the method observes a layer
(``on_attention_end``), while the engine applies a compaction (``make_writable`` +
``apply_compaction``) and while the attention backend gathers the observed keys (``_observe``) is
counted with a ``TorchDispatchMode``:

- launches: ops that run a kernel on a GPU (everything but views, metadata ops and work on host
  tensors: ``torch.tensor`` data and ``table_slots``, tagged and followed through the ops); a
  ``compact_kv`` call counts as one launch (its Triton kernel; the CPU runs its reference);
- syncs: ``_local_scalar_dense`` (``int()``, ``.item()``) and ``.tolist()`` of a device tensor, ``nonzero``
  (sizes its output on the host) and copies from host memory to the pool's device that are not
  ``non_blocking`` from pinned memory (``torch.tensor(..., device=cuda)`` and ``.to(cuda)`` of a
  pageable tensor block the host until the stream drains). On CPU those copies are no-ops, so
  ``torch.tensor``/``Tensor.to`` calls that name the pool's device are counted by wrapping them.

Usage: ``uv run python results/agent/count_compression_ops.py`` (about 20 s; prints JSON).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

VIEWS = {
    "view", "_unsafe_view", "expand", "slice", "transpose", "t", "permute", "unsqueeze", "squeeze", "select",
    "alias", "detach", "as_strided", "_reshape_alias", "reshape", "split", "unbind", "lift_fresh", "empty",
    "empty_strided", "_to_copy_noop", "clone_noop", "unflatten", "flatten", "split_with_sizes", "narrow",
}  # fmt: skip
SYNC_OPS = {"_local_scalar_dense", "nonzero", "item"}

REGION: list[str] = []
COUNTS: Counter = Counter()


class _Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs)) if REGION else ()
        host = any(getattr(t, "_host", False) for t in leaves if isinstance(t, torch.Tensor))
        out = func(*args, **kwargs)
        if REGION and REGION[-1] not in ("host", "kernel") and not host:
            name = func._schema.name.split("::")[-1]
            region = REGION[-1]
            if name in SYNC_OPS:
                COUNTS[(region, "syncs")] += 1
            elif name not in VIEWS and not (name == "to" and out is args[0]):  # ``.to`` of what already fits
                COUNTS[(region, "launches")] += 1
        if host:  # work on host tensors stays on the host (a pinned copy of it is what travels)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t._host = True
        return out


@contextmanager
def region(name: str):
    REGION.append(name)
    try:
        yield
    finally:
        REGION.pop()


def _wrap(obj, attr: str, name: str):
    orig = getattr(obj, attr)

    def wrapped(*a, **k):
        with region(name):
            return orig(*a, **k)

    setattr(obj, attr, wrapped)


def _counted_region() -> str:
    return REGION[-2] if REGION[-1] == "kernel" else REGION[-1]


def _kernel(fn):
    """``fn`` is one kernel launch on the GPU (its CPU reference's ops are not counted)."""

    def wrapped(*a, **k):
        if not REGION:
            return fn(*a, **k)
        COUNTS[(REGION[-1], "launches")] += 1
        with region("kernel"):
            return fn(*a, **k)

    return wrapped


def _host(fn):
    """Run ``fn`` as host work (its ops are not launches) and tag its tensor result as host memory."""

    def wrapped(*a, **k):
        with region("host"):
            out = fn(*a, **k)
        if isinstance(out, torch.Tensor):
            out._host = True
        return out

    return wrapped


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """What a copy to the GPU would return: the same values, no longer a host tensor."""
    with region("host"):
        out = t.view_as(t)
    out._host = False
    return out


def _pinned_copy(fn):
    """``to_device``: a pinned, non-blocking copy (one launch, no wait); a no-op on CPU."""

    def wrapped(t, device):
        if not REGION:
            return fn(t, device)
        COUNTS[(REGION[-1], "launches")] += 1
        return _on_device(fn(t, device))

    return wrapped


def _count_h2d(modules):
    """Count host->device copies that would block: ``torch.tensor(..., device=d)``, and ``x.to(d)`` of a
    host tensor (``torch.tensor`` without a device, or ``table_slots``) without ``non_blocking``. The pool
    lives on the CPU here, so these are counted by wrapping the calls, not by what they do."""
    orig_tensor, orig_to = torch.tensor, torch.Tensor.to

    def tensor(*a, **k):
        if REGION and REGION[-1] != "host" and k.get("device") is not None:
            COUNTS[(_counted_region(), "syncs")] += 1
        with region("host"):
            out = orig_tensor(*a, **k)
        if REGION and k.get("device") is None:
            out._host = True
        return out

    def to(self, *a, **k):
        dev = k.get("device", a[0] if a and isinstance(a[0], torch.device | str) else None)
        if REGION and dev is not None and getattr(self, "_host", False) and not k.get("non_blocking", False):
            COUNTS[(_counted_region(), "syncs")] += 1
        out = orig_to(self, *a, **k)
        if dev is not None and getattr(out, "_host", False):
            out = _on_device(out)
        return out

    orig_tolist = torch.Tensor.tolist

    def tolist(self):
        if REGION and REGION[-1] not in ("host", "kernel") and not getattr(self, "_host", False):
            COUNTS[(REGION[-1], "syncs")] += 1  # reads device memory: waits for the stream
        return orig_tolist(self)

    torch.tensor, torch.Tensor.to, torch.Tensor.tolist = tensor, to, tolist
    for mod in modules:
        if hasattr(mod, "table_slots"):
            mod.table_slots = _host(mod.table_slots)
        if hasattr(mod, "to_device"):
            mod.to_device = _pinned_copy(mod.to_device)
        if hasattr(mod, "compact_kv"):
            mod.compact_kv = _kernel(mod.compact_kv)


def main() -> dict:
    import transformers as tf

    from sparse_serve import LLM, SamplingParams
    from sparse_serve import chains as chains_mod
    from sparse_serve import engine as engine_mod
    from sparse_serve import paged_attention as pa_mod

    torch.manual_seed(0)
    config = tf.Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = tf.Qwen3ForCausalLM(config).eval()
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    llm = LLM(
        path, device="cpu", dtype="bfloat16", block_size=16, max_num_batched_tokens=512, max_num_seqs=4,
        sparse_method="snapkv", sink_keep_tokens=16, decode_keep_tokens=160, recent_keep_tokens=64,
        observation_window_size=32,
    )  # fmt: skip
    eng = llm.engine
    method = type(eng.method)
    _wrap(method, "on_attention_end", "method.on_attention_end")
    _wrap(chains_mod.EngineChains, "make_writable", "chains.make_writable")
    _wrap(engine_mod, "apply_compaction", "kv_compaction.apply_compaction")
    _wrap(pa_mod.PagedAttention, "_observe", "paged_attention._observe (gather)")
    from sparse_serve import kv_compaction as kc_mod

    _count_h2d([kc_mod, pa_mod, chains_mod])
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    out = {}
    history = 0
    with _Count():
        for turn, n in enumerate((600, 400)):
            COUNTS.clear()
            toks = torch.randint(3, 384, (n,), generator=gen).tolist()
            kw = {"chain_append_start": history} if turn else {}
            res = llm.generate(toks, greedy, chain_id="c", **kw)[0]
            history += n + len(res.token_ids)
            counts = {f"{r} {k}": v for (r, k), v in sorted(COUNTS.items())}
            for kind in ("launches", "syncs"):
                counts[f"total {kind}"] = sum(v for (_, k), v in COUNTS.items() if k == kind)
            out[f"turn {turn} ({'resumed, ' if turn else ''}{n} new tokens)"] = counts
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1)
    print()
