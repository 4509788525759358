"""QueryRing: what ``latest`` reads back equals a plain per-request list of the recorded queries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_methods.query_ring import QueryRing


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_ring_reads_back_the_latest_recorded_queries(data):
    window, num_rows, batch = data.draw(st.integers(1, 4)), 3, 4
    ring = QueryRing(2, num_rows, window, 2, 3, batch, torch.float32, "cpu")
    recorded: dict[str, list[torch.Tensor]] = {}  # per request, per layer pair: since the last clear
    live: set[str] = set()
    for _ in range(data.draw(st.integers(1, 12))):
        rows = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d", None]), max_size=batch, unique=True))
        if len({r for r in rows if r is not None} | live) > num_rows:
            continue  # more requests than rows: the engine never runs more than it has rows for
        ring.plan(rows)
        live |= {r for r in rows if r is not None}
        q = torch.randn(2, min(batch, len(rows) + data.draw(st.integers(0, 1))), 2, 3)  # padding records nothing
        for layer in range(2):
            ring.record(layer, q[layer])
        for i, rid in enumerate(rows):
            if rid is not None:
                recorded.setdefault(rid, []).append(q[:, i])
        for rid in sorted(live):
            n = min(len(recorded.get(rid, [])), window)
            assert ring.num_pending(rid) == n
            for layer in range(2):
                want = torch.stack([x[layer] for x in recorded.get(rid, [])[-n:]]) if n else torch.zeros(0, 2, 3)
                assert torch.equal(ring.latest(rid, layer), want)
        event = data.draw(st.sampled_from(["none", "clear", "release"]))
        if event != "none" and live:
            rid = data.draw(st.sampled_from(sorted(live)))
            recorded.pop(rid, None)
            if event == "release":
                ring.release(rid)
                live.discard(rid)
            else:
                ring.clear(rid)


def test_rows_are_reused_and_run_out():
    ring = QueryRing(1, 2, 2, 1, 1, 3, torch.float32, "cpu")
    ring.plan(["a", "b"])
    with pytest.raises(RuntimeError, match="no free query-ring row"):
        ring.plan(["c"])
    ring.release("a")
    ring.plan(["c", None, "b"])
    ring.record(0, torch.tensor([[[1.0]], [[2.0]], [[3.0]]]))
    assert ring.latest("c", 0).flatten().tolist() == [1.0] and ring.num_pending("a") == 0
    assert ring.dest.tolist() == [0, 4, 3]  # c took a's row 0; the unrecorded row writes the scratch row
