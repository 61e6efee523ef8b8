import dataclasses

import pytest

from engine.sampling import SamplingParams, SamplingParamsError


def test_defaults_are_valid_and_match_the_documented_values():
    p = SamplingParams()
    p.validate()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k) == (
        128,
        0,
        1.0,
        1.0,
        -1,
    )
    assert (p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (
        0.0,
        1.0,
        0.0,
        0.0,
    )
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.n == 1
    assert not p.ignore_eos and not p.logprobs and p.top_logprobs == 0 and p.skip_special_tokens
    # mutable defaults are not shared between instances
    assert SamplingParams().stop is not p.stop


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams.from_dict({"stop": "###"}).stop == ["###"]
    assert SamplingParams.from_dict({"stop": ["a", "bc"]}).stop == ["a", "bc"]
    assert SamplingParams(stop=("x",)).stop == ["x"]


def test_integers_are_accepted_for_float_fields():
    p = SamplingParams.from_dict({"temperature": 0, "top_p": 1, "repetition_penalty": 2})
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float) and isinstance(p.repetition_penalty, float)


def test_none_means_default_in_from_dict():
    p = SamplingParams.from_dict({"temperature": None, "top_p": None, "seed": None, "stop": None})
    assert p == SamplingParams()


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("temperature", -1.0, "temperature must be >= 0 (0 means greedy), got -1.0"),
        ("temperature", float("nan"), "temperature must be >= 0"),
        ("temperature", float("inf"), "temperature must be >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_k", -2, "top_k must be -1 or 0 (off) or >= 1, got -2"),
        ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
        ("min_p", -0.1, "min_p must be in [0, 1]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0 (1 means off), got 0.0"),
        ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
        ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2] (0 means off), got 2.5"),
        ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2]"),
        ("presence_penalty", -3.0, "presence_penalty must be in [-2, 2] (0 means off), got -3.0"),
        ("max_new_tokens", -1, "max_new_tokens must be >= 0, got -1"),
        (
            "min_new_tokens",
            200,
            "min_new_tokens must be between 0 and max_new_tokens (128), got 200",
        ),
        ("min_new_tokens", -1, "min_new_tokens must be between 0 and max_new_tokens"),
        ("n", 0, "n must be >= 1, got 0"),
        ("top_logprobs", 21, "top_logprobs must be between 0 and 20, got 21"),
        ("stop", [""], "stop must contain only non-empty strings"),
        ("stop_token_ids", [-1], "stop_token_ids must contain only token ids >= 0"),
        ("seed", 2**64, "seed must be in [-2**63, 2**64)"),
    ],
)
def test_out_of_range_values_name_the_field_and_the_range(field, value, expected):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict({field: value})
    assert expected in str(err.value)
    assert err.value.field == field
    # validate() on a directly constructed object gives the same error
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("temperature", "0.7", "temperature must be a number, got '0.7' (str)"),
        ("temperature", True, "temperature must be a number"),
        ("top_k", 2.0, "top_k must be an integer, got 2.0 (float)"),
        ("max_new_tokens", True, "max_new_tokens must be an integer"),
        ("ignore_eos", 1, "ignore_eos must be a boolean, got 1 (int)"),
        ("logprobs", "yes", "logprobs must be a boolean"),
        ("seed", 1.5, "seed must be an integer or null"),
        ("stop", 3, "stop must be a string or a list of strings, got 3"),
        ("stop", ["a", 1], "stop must be a string or a list of strings"),
        ("stop_token_ids", [1, "2"], "stop_token_ids must be a list of integers"),
        ("stop_token_ids", 5, "stop_token_ids must be a list of integers"),
    ],
)
def test_wrong_types_name_the_field_and_the_expected_type(field, value, expected):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict({field: value})
    assert expected in str(err.value)
    assert err.value.field == field


def test_unknown_field_is_named_with_a_suggestion_and_the_known_fields():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict({"temprature": 0.5})
    message = str(err.value)
    assert "unknown sampling parameter 'temprature'" in message
    assert "Did you mean 'temperature'?" in message
    for f in dataclasses.fields(SamplingParams):
        assert f.name in message
    assert err.value.field == "temprature"


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"top_p": 2})


def test_top_logprobs_needs_logprobs():
    with pytest.raises(SamplingParamsError, match="top_logprobs must be 0 unless logprobs is true"):
        SamplingParams.from_dict({"top_logprobs": 5})
    assert SamplingParams.from_dict({"logprobs": True, "top_logprobs": 20}).top_logprobs == 20


def test_boundary_values_are_accepted():
    SamplingParams.from_dict(
        {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 1.0,
            "repetition_penalty": 1e-3,
            "frequency_penalty": -2.0,
            "presence_penalty": 2.0,
            "max_new_tokens": 0,
            "min_new_tokens": 0,
            "seed": -1,
            "n": 4,
            "stop_token_ids": [0, 7],
        }
    )
    SamplingParams.from_dict(
        {"min_new_tokens": 5, "max_new_tokens": 5, "top_k": 1, "seed": 2**64 - 1}
    )


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1, temperature=0.8).is_greedy
    assert not SamplingParams(temperature=0.8).is_greedy
    assert not SamplingParams(top_k=2).is_greedy


def test_uses_penalties():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(frequency_penalty=0.5).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
