"""DecodeScoreSums: the per-request sums equal plain per-request accumulation of the CSR score columns."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_methods.decode_score_sums import DecodeScoreSums

BLOCK, CAPACITY, HKV = 4, 10, 2


@settings(max_examples=50, deadline=None, derandomize=True)
@given(data=st.data(), heads=st.sampled_from([1, HKV]))
def test_sums_add_each_rows_columns_and_follow_compactions(data, heads):
    sums = DecodeScoreSums(2, 3, CAPACITY, heads, HKV, BLOCK, 4, "cpu")
    lens: dict[str, int] = {}
    want: dict[str, list[torch.Tensor]] = {}  # per request, per layer: [heads, len]
    for _ in range(data.draw(st.integers(1, 8))):
        ids = data.draw(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=4, unique=True))
        rows = []
        for rid in ids:
            if rid is None:
                rows.append((None, data.draw(st.integers(1, 2 * CAPACITY))))
                continue
            if lens.get(rid, 0) >= CAPACITY:
                continue  # the method compacts before that
            if rid not in sums:
                n = data.draw(st.integers(0, CAPACITY - 1))
                start = [torch.rand(heads, n) for _ in range(2)]
                sums.load(rid, n, [start[0], None])
                want[rid], lens[rid] = [start[0], torch.zeros(heads, n)], n
            lens[rid] += 1
            rows.append((rid, lens[rid]))
        sums.plan(rows)
        sums.scores.copy_(torch.rand_like(sums.scores))  # the kernel's output; stale columns included
        start = 0
        for rid, kv_len in rows:
            if rid is not None:
                cols = sums.scores[:, start : start + kv_len]
                cols = cols if heads == HKV else cols.sum(0, keepdim=True)
                want[rid] = [torch.cat([w, torch.zeros(heads, kv_len - w.shape[1])], 1) + cols for w in want[rid]]
            start += -(-kv_len // BLOCK) * BLOCK
        for layer in range(2):
            sums.add_decode(layer)
        for rid in {r for r, _ in rows if r is not None}:
            for layer in range(2):
                assert torch.allclose(sums.row(rid, layer), want[rid][layer])
        if data.draw(st.booleans()) and want:  # compact one request's layer 1
            rid = data.draw(st.sampled_from(sorted(want)))
            keep = torch.sort(torch.randperm(lens[rid])[: max(1, lens[rid] // 2)]).values.expand(HKV, -1)
            sums.compact(rid, 1, keep.contiguous())
            want[rid][1] = torch.gather(want[rid][1], 1, keep[:heads])
            assert torch.equal(sums.row(rid, 1), want[rid][1])
            out = sums.unload(rid)
            assert torch.equal(out[1], want[rid][1]) and torch.equal(out[0], want[rid][0])
            del want[rid], lens[rid]
