"""One text per seed through the server: a seeded request gives the same text alone, among concurrent batch-mates and
as a choice of `n` > 1 (choice i is seed + i), in every strategy; in the exact mode the step's draft decision (alone
a sequence drafts, in a wide batch it does not, by the forward costs the model carries) changes nothing, and the
text is AR sampling's at the same seed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import MODEL, live_server

openai = pytest.importorskip("openai")

PROMPTS = ["tell me", "what is 2+2?", "hello there", "xyz"]
MATES = ["a", "bb", "abc abc abc", "the the the"]  # other requests decoded at the same time


@pytest.fixture(scope="module")
def priced():
    """The tiny model (its own instance) with forward costs where one sequence drafts and a batch of 4 does not."""
    from refusion.decode.costs import ForwardCosts
    from refusion.model.setup import attach_setup, plain_setup
    from refusion.model.tiny import tiny_model, tiny_tokenizer

    model = tiny_model()
    attach_setup(model, plain_setup(model).replace(forward_costs=ForwardCosts((1, 4, 8, 64), (1.0, 1.05, 2.0, 16.0))))
    return model, tiny_tokenizer()


def chat(client, prompt: str, strategy: str, **kwargs):
    settings = {"strategy": strategy} | ({"lookup_length": 4} if strategy == "speculative" else {})
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
                                          temperature=1.0, extra_body={"refusion": settings}, **kwargs)


def texts(response) -> list[str]:
    return [c.message.content for c in response.choices]


@pytest.mark.parametrize("strategy", ["speculative", "autoregressive", "refusion"])
def test_a_seed_gives_one_text_alone_batched_and_as_a_choice(priced, strategy):
    with live_server(priced, max_batch_size=4, max_queue=16) as live:
        client = live.client()
        alone = {(p, s): texts(chat(client, p, strategy, seed=s))[0] for p in PROMPTS for s in (7, 8, 9)}
        requests = [(p, 7) for p in PROMPTS] + [(m, 100 + i) for i, m in enumerate(MATES)]
        with ThreadPoolExecutor(len(requests)) as pool:  # concurrent: batched with each other
            together = list(pool.map(lambda r: texts(chat(client, r[0], strategy, seed=r[1]))[0], requests))
            choices = list(pool.map(lambda p: texts(chat(client, p, strategy, seed=7, n=3)), PROMPTS))
        assert together[: len(PROMPTS)] == [alone[(p, 7)] for p in PROMPTS]
        assert choices == [[alone[(p, s)] for s in (7, 8, 9)] for p in PROMPTS]
        assert len(set(alone.values())) > len(PROMPTS)  # the seeds sample different texts
        if strategy == "speculative":  # AR sampling's text, token for token
            assert all(texts(chat(client, p, "autoregressive", seed=s))[0] == text for (p, s), text in alone.items())
            drafted = chat(client, PROMPTS[0], strategy, seed=7).choices[0].model_extra["refusion"]["drafted"]
            assert drafted > 0  # alone it drafts (a batch of 4 at these costs drafts nothing)
