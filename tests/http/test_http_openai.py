"""The OpenAI-compatible endpoints against a real replica (torch engine), through the official `openai`
client: completions and chat, streaming and not, logprobs in OpenAI's shapes equal to the gRPC path's
numbers for the same seed, token ids that round-trip, n choices, stop strings, tool calls."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import openai
import pytest

from maskroll.app.model_init import BOS_ID, EOS_ID
from maskroll.client import RolloutClient, SamplingOptions

PROMPT_IDS = [256, *b"Hello, world"]


def grpc_records(served, prompt_ids, **options):
    async def main():
        async with RolloutClient(served.grpc_address, token=served.headers["Authorization"][7:]) as c:
            return await c.generate_records(prompt_ids, SamplingOptions(**options))

    return asyncio.run(main())


def test_models_lists_the_served_model(served):
    models = served.openai().models.list()
    assert [m.id for m in models.data] == ["model"]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_completion_top_logprobs_are_the_grpc_numbers_for_the_same_seed(served):
    out = served.openai().completions.create(
        model="model",
        prompt=PROMPT_IDS,
        max_tokens=6,
        seed=11,
        logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == PROMPT_IDS
    (rec,) = grpc_records(served, PROMPT_IDS, max_tokens=6, seed=11, logprobs_k=5, ignore_eos=True)
    assert ids == rec.completion_ids.tolist()
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(PROMPT_IDS)
    lp = choice.logprobs
    # logprobs travel as the shortest decimals of their float32: the gRPC record's values, bit for bit
    np.testing.assert_array_equal(np.float32(lp.token_logprobs), rec.sampled_logprobs)
    for t in range(6):
        top = lp.top_logprobs[t]
        # keyed by token text: distinct ids may share one (U+FFFD); each text keeps its best rank
        texts = served_token_texts(served, rec.topk_ids[t].tolist())
        first = {}
        for text, value in zip(texts, rec.topk_logprobs[t].tolist(), strict=True):
            first.setdefault(text, value)
        assert list(top) == list(first)
        np.testing.assert_array_equal(np.float32(list(top.values())), np.float32(list(first.values())))
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert "".join(lp.tokens) == "".join(served_token_texts(served, ids))
    assert lp.text_offset == list(np.cumsum([0, *map(len, lp.tokens[:-1])]))


def served_token_texts(served, ids):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.replica.config.model)
    return [tok.decode([i]) for i in ids]


def test_chat_logprobs_are_sorted_and_the_grpc_numbers_for_the_same_seed(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    out = served.openai().chat.completions.create(
        model="model",
        messages=messages,
        max_tokens=5,
        seed=3,
        logprobs=True,
        top_logprobs=20,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt = out.model_extra["prompt_token_ids"]
    assert prompt == template_ids("<bos><|system|>\nBe brief.<eos>\n<|user|>\nSay hi<eos>\n<|assistant|>\n")
    (rec,) = grpc_records(served, prompt, max_tokens=5, seed=3, logprobs_k=20, ignore_eos=True)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == rec.completion_ids.tolist()
    content = choice.logprobs.content
    assert len(content) == 5
    for t, entry in enumerate(content):
        assert np.float32(entry.logprob) == rec.sampled_logprobs[t]
        tops = [e.logprob for e in entry.top_logprobs]
        assert len(tops) == 20 and tops == sorted(tops, reverse=True)
        np.testing.assert_array_equal(np.float32(tops), rec.topk_logprobs[t])
        for e, token_id in zip(entry.top_logprobs, rec.topk_ids[t].tolist(), strict=True):
            if token_id < 256:  # a byte token: its own byte, even when it is half a UTF-8 character
                assert e.bytes == [token_id]


def template_ids(text: str) -> list[int]:
    """The tiny model's ids of `text`: a byte per byte, <bos> / <eos> as their special ids."""
    out = []
    for part in re.split(r"(<bos>|<eos>)", text):
        out += [BOS_ID] if part == "<bos>" else [EOS_ID] if part == "<eos>" else list(part.encode())
    return out


def test_streaming_gives_the_same_tokens_text_and_logprobs_as_not_streaming(served):
    c = served.openai()
    kw = dict(model="model", max_tokens=12, seed=5, extra_body={"return_token_ids": True, "ignore_eos": True})
    messages = [{"role": "user", "content": "Count to five"}]
    whole = c.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw)
    chunks = list(
        c.chat.completions.create(
            messages=messages,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []]
    lps = [
        e.logprob
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert text == whole.choices[0].message.content
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert lps == [e.logprob for e in whole.choices[0].logprobs.content]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []

    stream = c.completions.create(prompt="Once upon", stream=True, logprobs=1, **kw)
    pieces = list(stream)
    plain = c.completions.create(prompt="Once upon", logprobs=1, **kw)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert [t for p in pieces for t in p.choices[0].model_extra["token_ids"]] == plain.choices[0].model_extra[
        "token_ids"
    ]


def test_token_ids_round_trip_as_a_prompt(served):
    c = served.openai()
    first = c.completions.create(
        model="model",
        prompt="abc",
        max_tokens=4,
        seed=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0]
    prompt = first.model_extra["prompt_token_ids"]
    assert prompt == [256, *b"abc"]  # text prompts get the tokenizer's BOS, as vLLM's completions do
    again = c.completions.create(
        model="model",
        prompt=prompt,
        max_tokens=4,
        seed=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0]
    assert again.model_extra["token_ids"] == first.model_extra["token_ids"] and again.text == first.text


def test_n_choices_are_the_grpc_samples_seeded_seed_plus_i(served, monkeypatch):
    from maskroll.server.generation import validation

    checked = []  # the sampling options validated: once for the call, its n choices included
    real = validation.sampling_params
    monkeypatch.setattr(validation, "sampling_params", lambda p, o, c: checked.append(o.n) or real(p, o, c))
    out = served.openai().completions.create(
        model="model",
        prompt=PROMPT_IDS,
        n=3,
        max_tokens=4,
        seed=40,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert checked == [3]
    recs = grpc_records(served, PROMPT_IDS, max_tokens=4, seed=40, n=3, logprobs_k=0, ignore_eos=True)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in out.choices] == [r.completion_ids.tolist() for r in recs]
    assert out.usage.completion_tokens == 12


def test_a_stop_string_ends_the_choice_after_the_token_that_completed_it(served):
    c = served.openai()
    kw = dict(
        model="model", prompt=PROMPT_IDS, seed=8, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    free = c.completions.create(max_tokens=40, **kw).choices[0]
    ids = free.model_extra["token_ids"]
    # a stop string made of two tokens from the middle of the free run (same seed: same tokens)
    texts = served_token_texts(served, ids)
    j = next(
        i
        for i in range(3, 38)
        if texts[i].isprintable() and texts[i + 1].isprintable() and "\ufffd" not in texts[i] + texts[i + 1]
    )
    stop = texts[j] + texts[j + 1]
    cut = c.completions.create(max_tokens=40, stop=[stop], **kw).choices[0]
    first_hit = free.text.find(stop)
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:first_hit]
    n = len(cut.model_extra["token_ids"])
    assert cut.model_extra["token_ids"] == ids[:n]
    assert stop in "".join(texts[:n]) and stop not in "".join(texts[: n - 1])
    streamed = list(c.completions.create(max_tokens=40, stop=stop, stream=True, **kw))
    assert "".join(p.choices[0].text for p in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_eos_ends_a_chat_turn_with_stop(served):
    # The engine stops on the model's EOS (the template's end of turn): 32 choices of 64 tokens, seeded
    # 0..31, of which the tiny model ends some with EOS (seed-determined, so always the same ones).
    out = served.openai().chat.completions.create(
        model="model",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=64,
        n=32,
        seed=0,
        extra_body={"return_token_ids": True},
    )
    stopped = [ch for ch in out.choices if ch.finish_reason == "stop"]
    assert stopped and len(stopped) < 32
    for ch in out.choices:
        ids = ch.model_extra["token_ids"]
        assert (ids[-1] == EOS_ID) == (ch.finish_reason == "stop") and EOS_ID not in ids[:-1]
        assert len(ids) == 64 or ch.finish_reason == "stop"
        assert "<eos>" not in (ch.message.content or "")


def test_tool_calls_are_parsed_from_the_hermes_format():
    from maskroll.server.http_api.chat import parse_tool_calls

    content, calls = parse_tool_calls(
        'Let me compute.<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'
    )
    assert content == "Let me compute."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "calc", {"e": "2*3"})
    ]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_unknown_model_is_404_and_unsupported_parameters_are_400(served):
    c = served.openai()
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert "model 'gpt-4' is not served here" in err.value.body["message"]
    for extra in ({"presence_penalty": 0.5}, {"logit_bias": {"65": 3}}, {"echo": True}, {"best_of": 3}):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model="model", prompt="x", max_tokens=1, **extra)
        assert "is not supported" in err.value.body["message"], extra
    with pytest.raises(openai.BadRequestError, match="tool_choice is not supported"):
        c.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )


def test_tokens_outside_top_k_have_vllms_finite_floor_so_the_json_stays_strict(served):
    def strict(const: str):
        raise AssertionError(f"non-standard JSON constant {const}")

    with served.http() as c:
        body = {
            "model": "model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "seed": 2,
            "top_k": 3,
            "logprobs": True,
            "top_logprobs": 5,
            "ignore_eos": True,
        }
        r = c.post("/v1/chat/completions", json=body)
    out = json.loads(r.text, parse_constant=strict)
    for entry in out["choices"][0]["logprobs"]["content"]:
        tops = [e["logprob"] for e in entry["top_logprobs"]]
        assert tops[3:] == [-9999.0, -9999.0]  # μ = 0 beyond top_k = 3
        assert all(-9999.0 < x <= 0 for x in tops[:3]) and abs(np.logaddexp.reduce(tops[:3])) < 1e-5
