"""Scheduler properties over random workloads, with a fake model that only advances counters."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_cache import KVCacheManager
from sparse_serve.request import Request, RequestStatus
from sparse_serve.sampling_params import SamplingParams
from sparse_serve.scheduler import Scheduler


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.integers(1, 6),
    budget=st.integers(1, 32),
    num_blocks=st.integers(14, 40),
    max_num_seqs=st.integers(1, 5),
)
def test_every_request_finishes_within_budgets(prompts, max_tokens, budget, num_blocks, max_num_seqs):
    block_size = 4
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    reqs = [
        Request(str(i), [i % 3] * n, SamplingParams(max_tokens=max_tokens), arrival=i) for i, n in enumerate(prompts)
    ]
    for r in reqs:
        sched.add(r)
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch, "no progress"
        assert batch.num_tokens <= budget
        assert len({r.request_id for r, _ in batch.items}) == len(batch.items) <= max_num_seqs
        sizes = [n for _, n in batch.items]
        assert sizes == sorted(sizes, key=lambda n: n > 1)
        for r, n in batch.items:
            assert r.status is RequestStatus.RUNNING and r not in batch.preempted
            assert len(kv.table(r.request_id).block_ids) * block_size >= r.num_computed_tokens + n
            r.num_computed_tokens += n
            r.kv_lens = [kv_len + n for kv_len in r.kv_lens]
            kv.cache_blocks(r.request_id, r.token_ids, r.num_computed_tokens)
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(7)
                if len(r.output_token_ids) >= max_tokens:
                    sched.finish(r, "length")
    assert not sched.has_unfinished()
    assert all(len(r.output_token_ids) == max_tokens for r in reqs)
    assert kv.pool.num_used_blocks == 0
