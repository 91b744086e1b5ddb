"""Request validation as pure functions: every rejected input names its field; good input maps to the
engine's parameters exactly (the gRPC path of the same inputs is in test_bad_input.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from maskroll.proto.records import SamplingOptions
from maskroll.proto.sampling import temperature_problem
from maskroll.server.engines.contract import EngineLimits, EngineRequest, SamplingParams, check_request
from maskroll.server.errors import InvalidArgument
from maskroll.server.generation.validation import (
    Caps,
    check_ids,
    check_prompt,
    engine_requests,
    sampling_params,
)

CAPS = Caps(vocab_size=100, max_model_len=64, max_logprobs=20, max_tokens=50, max_n=8)
PROMPT = np.array([1, 2, 3], np.int32)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(temperature=0.0), "options.temperature"),
        (dict(temperature=-1.0), "options.temperature"),
        (dict(temperature=math.nan), "options.temperature"),
        (dict(temperature=math.inf), "options.temperature"),
        (dict(top_p=0.0), "options.top_p"),
        (dict(top_p=1.5), "options.top_p"),
        (dict(top_p=math.nan), "options.top_p"),
        (dict(top_k=-2), "options.top_k"),
        (dict(top_k=101), "options.top_k"),
        (dict(max_tokens=0), "options.max_tokens"),
        (dict(max_tokens=-5), "options.max_tokens"),
        (dict(max_tokens=51), "options.max_tokens"),  # above the server cap
        (dict(logprobs_k=21), "options.logprobs_k"),
        (dict(logprobs_k=-1), "options.logprobs_k"),
        (dict(n=9), "options.n"),
        (dict(n=-1), "options.n"),
        (dict(seed=2**63 - 1, n=2), "options.seed"),
        (dict(stop_token_ids=(5, 100)), "options.stop_token_ids[1]"),
        (dict(stop_token_ids=(-1,)), "options.stop_token_ids[0]"),
    ],
)
def test_bad_option_is_invalid_argument_naming_the_field(options, field):
    with pytest.raises(InvalidArgument) as err:
        sampling_params(PROMPT, SamplingOptions(**{"max_tokens": 5, "logprobs_k": 2, **options}), CAPS)
    assert str(err.value).startswith(field), str(err.value)


def test_context_overflow_names_max_tokens_and_the_numbers():
    prompt = np.arange(20, dtype=np.int32)
    sampling_params(prompt, SamplingOptions(max_tokens=44), CAPS)  # 20 + 44 = 64: exactly fits
    with pytest.raises(InvalidArgument) as err:
        sampling_params(prompt, SamplingOptions(max_tokens=45), CAPS)
    assert str(err.value).startswith("options.max_tokens") and "20 + 45 > max_model_len 64" in str(err.value)


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([], "prompt_token_ids is empty"),
        ([1, 100, 2], "prompt_token_ids[1] = 100 is outside the vocabulary [0, 100)"),
        ([-1], "prompt_token_ids[0] = -1"),
        (list(range(64)), "prompt_token_ids has 64 tokens"),
    ],
)
def test_bad_prompt_names_the_position(prompt, needle):
    with pytest.raises(InvalidArgument) as err:
        check_prompt(np.array(prompt, np.int32), CAPS)
    assert needle in str(err.value)


@pytest.mark.parametrize("field", ["request_id", "job_id", "group_id"])
def test_ids_are_bounded_and_printable(field):
    ids = {"request_id": "", "job_id": "", "group_id": ""}
    with pytest.raises(InvalidArgument, match=f"^{field} has 257"):
        check_ids(**{**ids, field: "x" * 257})
    with pytest.raises(InvalidArgument, match=f"^{field} "):
        check_ids(**{**ids, field: "a\nb"})
    check_ids(**{**ids, field: "x" * 256})


def test_good_options_map_to_engine_params():
    o = SamplingOptions(
        max_tokens=7,
        temperature=0.5,
        top_p=0.8,
        top_k=-1,
        logprobs_k=3,
        n=1,
        seed=4,
        stop_token_ids=(9, 9, 8),
    )
    p = sampling_params(PROMPT, o, CAPS)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.logprobs_k, p.seed) == (7, 0.5, 0.8, 0, 3, 4)
    assert p.stop_token_ids == (9, 8)


def test_caps_take_the_narrower_limit():
    from maskroll.server.engines.contract import EngineLimits

    caps = Caps.of(
        EngineLimits(vocab_size=10, max_model_len=32, max_logprobs=20), max_logprobs=15, max_tokens=5, max_n=2
    )
    assert (caps.max_logprobs, caps.vocab_size, caps.max_model_len) == (10, 10, 32)
    caps = Caps.of(
        EngineLimits(vocab_size=1000, max_model_len=32, max_logprobs=20),
        max_logprobs=15,
        max_tokens=5,
        max_n=2,
    )
    assert caps.max_logprobs == 15


def test_engine_requests_number_the_samples_and_offset_the_seed():
    p = sampling_params(PROMPT, SamplingOptions(max_tokens=3, seed=100, n=3), CAPS)
    reqs = engine_requests("r", PROMPT, p, 3)
    assert [(q.request_id, q.params.seed) for q in reqs] == [("r-0", 100), ("r-1", 101), ("r-2", 102)]
    assert all(q.params.max_tokens == 3 for q in reqs)
    unseeded = engine_requests(
        "u", PROMPT, sampling_params(PROMPT, SamplingOptions(max_tokens=3, n=2), CAPS), 2
    )
    assert [q.params.seed for q in unseeded] == [None, None]


def test_model_eos_stops_unless_ignored():
    caps = Caps(
        vocab_size=100, max_model_len=64, max_logprobs=20, max_tokens=50, max_n=8, eos_token_ids=(99,)
    )
    prompt = np.array([1, 2], np.int32)
    p = sampling_params(prompt, SamplingOptions(max_tokens=5, stop_token_ids=(7, 99)), caps)
    assert p.stop_token_ids == (7, 99)  # no duplicate
    assert sampling_params(prompt, SamplingOptions(max_tokens=5), caps).stop_token_ids == (99,)
    assert sampling_params(prompt, SamplingOptions(max_tokens=5, ignore_eos=True), caps).stop_token_ids == ()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(temperature=0.0),
            "temperature must be finite and > 0, got 0.0 (there is no greedy mode: the record's logprobs "
            "must describe a distribution)",
        ),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(seed=2**63 - 2, n=3), f"seed = {2**63 - 2}: seed + n - 1 must be <= {2**63 - 1}"),
        (dict(stop_token_ids=tuple(range(1025))), "stop_token_ids has 1025 ids; at most 1024"),
    ],
)
def test_the_sdk_and_the_server_apply_one_rule_with_one_message(options, message):
    o = SamplingOptions(**{"max_tokens": 5, **options})
    assert o.problems() == [message]
    with pytest.raises(InvalidArgument) as err:
        sampling_params(PROMPT, o, CAPS)
    assert str(err.value) == f"options.{message}"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=0.0), temperature_problem(0.0)),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(logprobs_k=21), "logprobs_k must be in [0, 20], got 21"),
        (dict(stop_token_ids=tuple(range(1025))), "stop_token_ids has 1025 ids; at most 1024"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids[0] = -1 is negative"),
    ],
)
def test_the_engine_guard_asks_the_same_rule_of_its_parameters(params, message):
    # What reaches an engine without the pipeline (a direct caller, a test): the rule set of
    # validation, asked of the engine's parameters as they are (one sample), with the same message.
    limits = EngineLimits(vocab_size=100, max_model_len=64, max_logprobs=20)
    request = EngineRequest("guard-0", PROMPT, SamplingParams(**{"max_tokens": 5, **params}))
    with pytest.raises(ValueError) as err:
        check_request(request, limits)
    assert str(err.value) == message
    # the context and the vocabulary are no limits of the guard: the engine ends a sample at max_model_len
    check_request(EngineRequest("ok", PROMPT, SamplingParams(max_tokens=1000, stop_token_ids=(500,))), limits)


def test_without_server_limits_the_sdk_checks_only_what_holds_everywhere():
    # Fine for some server: the SDK lets them through and this server's limits refuse each.
    for over in (
        dict(top_k=101),
        dict(logprobs_k=21),
        dict(n=9),
        dict(max_tokens=51),
        dict(stop_token_ids=(100,)),
    ):
        o = SamplingOptions(**{"max_tokens": 5, **over})
        assert o.problems() == [], over
        with pytest.raises(InvalidArgument):
            sampling_params(PROMPT, o, CAPS)
    # Wrong for every server: all reported at once, each naming its field.
    o = SamplingOptions(top_k=-2, logprobs_k=-1, n=0, stop_token_ids=(4, -3))
    assert o.problems() == [
        "top_k must be >= -1 (-1 and 0 mean off), got -2",
        "logprobs_k must be >= 0, got -1",
        "n must be >= 1, got 0",
        "stop_token_ids[1] = -3 is negative",
    ]


def test_temperature_rule_accepts_numpy_scalars_and_refuses_non_numbers():
    assert temperature_problem(np.float32(0.25)) is None and temperature_problem(2) is None
    for bad in (0, -0.1, math.nan, -math.inf, np.float64(math.inf), "1.0", None):
        assert temperature_problem(bad).startswith(f"temperature must be finite and > 0, got {bad}"), bad
