import pytest

from sparse_serve import SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=[""]), "stop strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_values_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string_and_lists():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[5]).stop_token_ids == (5,)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
