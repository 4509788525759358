"""``Sampler.sample`` (tokens left on the device, fetched by ``tolist``) equals the blocking call."""

import torch

from sparse_serve.sampler import SampledTokens, Sampler
from sparse_serve.sampling_params import SamplingParams


def test_sample_then_fetch_equals_the_blocking_call():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=1.0),  # the engine generator
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_p=0.5, seed=9),
    ]
    ids = [str(i) for i in range(6)]
    blocking, deferred = Sampler(seed=3, device=torch.device("cpu")), Sampler(seed=3, device=torch.device("cpu"))
    for _ in range(8):
        pending = deferred.sample(logits, ids, params)
        assert isinstance(pending, SampledTokens)
        assert pending.tolist() == blocking(logits, ids, params)


def test_empty():
    assert SampledTokens.empty().tolist() == []
