"""`n` > 1: n choices per prompt, each its own sequence; seeds derived as seed + choice index."""

from __future__ import annotations

import pytest

from .conftest import MODEL

openai = pytest.importorskip("openai")

AR = {"refusion": {"strategy": "autoregressive"}}


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tell me"}], **kwargs)


def test_n_greedy_choices_are_identical_and_equal_one_choice(live):
    client = live.client()
    one = chat(client, max_tokens=10)
    three = chat(client, max_tokens=10, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once, as OpenAI does


@pytest.mark.parametrize("strategy", ["autoregressive", "refusion"])
def test_seeded_choice_i_is_the_single_request_with_seed_plus_i(live, strategy):
    client = live.client()
    settings = dict(max_tokens=12, temperature=2.0, extra_body={"refusion": {"strategy": strategy}})
    many = chat(client, n=3, seed=40, **settings)
    singles = [chat(client, seed=40 + i, **settings).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == singles
    if strategy == "autoregressive":
        assert len(set(singles)) > 1  # different seeds, different samples


def test_streamed_n_equals_non_streamed(live):
    client = live.client()
    whole = chat(client, max_tokens=12, n=2, temperature=1.5, seed=3, extra_body=AR)
    texts, finishes = {0: "", 1: ""}, {}
    chunks = list(chat(client, max_tokens=12, n=2, temperature=1.5, seed=3, extra_body=AR, stream=True,
                       stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_order_choices_prompt_major(live):
    client = live.client()
    response = client.completions.create(model=MODEL, prompt=["abc", "xyz"], n=2, max_tokens=6, extra_body=AR)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, extra_body=AR).choices[0].text
               for p in ("abc", "xyz")]
    assert [c.text for c in response.choices] == [singles[0], singles[0], singles[1], singles[1]]
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=["abc", "xyz"], n=2, max_tokens=6, extra_body=AR,
                                           stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in response.choices}


def test_n_out_of_range_is_a_400_naming_n(live):
    client = live.client()
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, n=n)
        assert e.value.body["param"] == "n"
