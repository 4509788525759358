import torch

from sparse_serve.sampler import Sampler, _filter_top_k_top_p, process_logits
from sparse_serve.sampling_params import SamplingParams


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    kept = torch.isfinite(_filter_top_k_top_p(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, False, True]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(_filter_top_k_top_p(probs.log(), top_k=0, top_p=0.8))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(_filter_top_k_top_p(probs.log(), top_k=0, top_p=0.81))
    assert kept.tolist() == [True, True, True, False]
    # The top token always survives.
    assert torch.isfinite(_filter_top_k_top_p(probs.log(), top_k=0, top_p=0.01)).tolist() == [True, False, False, False]


def test_greedy_and_seeded_sampling():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=1.0, seed=42)
    s = Sampler(seed=0, device=torch.device("cpu"))
    a = [s(logits, ["g", "x", "y"], [greedy, seeded, seeded]) for _ in range(5)]
    assert all(row[0] == int(logits[0].argmax()) for row in a)
    s2 = Sampler(seed=123, device=torch.device("cpu"))
    b = [s2(logits[1:2], ["x"], [seeded])[0] for _ in range(5)]
    # Request "x" drew the same sequence whatever else was in the batch and whatever the engine seed.
    assert [row[1] for row in a] == b
    assert len(set(b)) > 1  # and it is really sampling


def test_tiny_temperature_and_top_p_never_fail():
    """Regression (issue 20): temperature 1e-40 divided the logits to inf (NaN probabilities) and top_p
    1e-46 rounded to 0 in float32 and masked every token, so torch.multinomial raised."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-46, seed=4),
        SamplingParams(temperature=2.0, top_p=5e-324),
    ]
    s = Sampler(seed=0, device=torch.device("cpu"))
    tokens = s(logits, ["a", "b", "c", "d"], params)
    # Below 1e-5 the temperature is greedy; a vanishing top_p keeps only the most likely token.
    assert tokens == logits.argmax(dim=-1).tolist()
    assert SamplingParams(temperature=1e-5 / 2).greedy and not SamplingParams(temperature=1e-5).greedy


def test_a_row_without_finite_probabilities_falls_back_to_its_argmax():
    logits = torch.full((2, 8), float("nan"))
    logits[1] = torch.arange(8.0)
    logits[1, 5] = float("inf")
    s = Sampler(seed=0, device=torch.device("cpu"))
    tokens = s(logits, ["a", "b"], [SamplingParams(seed=1), SamplingParams(seed=2)])
    assert tokens[1] == 5 and 0 <= tokens[0] < 8


class _History:
    """The two fields of a Request that logit processing reads."""

    def __init__(self, token_ids, num_prompt_tokens):
        self.token_ids, self.num_prompt_tokens = token_ids, num_prompt_tokens
        self.num_output_tokens = len(token_ids) - num_prompt_tokens


def test_penalties_bias_and_min_tokens_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0, 0.0])
    history = _History([2, 3, 3, 1], num_prompt_tokens=1)  # prompt [2], output [3, 3, 1]
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={0: -3})
    out = process_logits(logits.clone(), p, history, eos=frozenset())
    # token 0: bias only; 1: seen (negative, x2), once in output; 2: prompt only (positive, /2); 3: output twice.
    expected = [2.0 - 3, -1.0 * 2 - 0.5 - 0.25, 0.5 / 2, 1.0 / 2 - 2 * 0.5 - 0.25, 0.0]
    assert torch.allclose(out, torch.tensor(expected))
    early = process_logits(logits.clone(), SamplingParams(min_tokens=4, stop_token_ids=[2]), history, frozenset({0}))
    assert torch.isinf(early[[0, 2]]).all() and torch.isfinite(early[[1, 3, 4]]).all()
    done = process_logits(logits.clone(), SamplingParams(min_tokens=3), history, frozenset({0}))
    assert torch.equal(done, logits)


def test_logprobs_of_sampled_tokens():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    sampled = Sampler(seed=0, device=torch.device("cpu")).sample(logits, ["a", "b", "c"], params)
    tokens, lps = sampled.tolist(), sampled.logprobs()
    ref = torch.log_softmax(logits, dim=-1)
    assert set(lps) == {0, 2}
    assert lps[0].token_id == tokens[0] and abs(lps[0].logprob - ref[0, tokens[0]].item()) < 1e-6
    assert [t for t, _ in lps[0].top] == ref[0].topk(3).indices.tolist() and lps[2].top == ()
    assert abs(lps[2].logprob - ref[2, tokens[2]].item()) < 1e-6
