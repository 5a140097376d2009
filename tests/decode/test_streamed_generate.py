"""`refusion generate` on a terminal: each answer is written as it is committed, and the whole of what is written
equals the piped output (the same headers, text and stats lines)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from refusion.cli import main
from refusion.config import DecodeConfig
from refusion.decode.cli import StreamedAnswers, answer_header, stats_line
from refusion.decode.loop import generate
from refusion.decode.stream import response_text
from refusion.model.loading import encode_prompts
from refusion.model.tiny import tiny_model, tiny_tokenizer

PROMPTS = ["hello there", "what is 2+2?", "abc"]
CONFIGS = {  # eos_token_id=0 (the pad id): long answers, so that each streams over many rounds
    "refusion": DecodeConfig(max_new_tokens=24, block_size=8, slot_size=4, eos_token_id=0),
    "speculative": DecodeConfig(strategy="speculative", max_new_tokens=24, eos_token_id=0),
    "autoregressive": DecodeConfig(strategy="autoregressive", max_new_tokens=24),
}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model(), tiny_tokenizer()


def piped(tokenizer, prompts, out, cfg) -> str:
    """What `refusion generate --stats` prints when piped."""
    return "".join(f"{answer_header(i, p)}\n{response_text(tokenizer, s)}\n{stats_line(cfg, st)}\n"
                   for i, (p, s, st) in enumerate(zip(prompts, out.sequences, out.stats.per_sequence)))


@pytest.mark.parametrize("strategy", sorted(CONFIGS))
def test_streamed_answers_write_the_piped_output_in_pieces(model_and_tokenizer, strategy):
    model, tokenizer = model_and_tokenizer
    cfg = CONFIGS[strategy]
    writes = []
    answers = StreamedAnswers(tokenizer, PROMPTS, cfg, write=writes.append)
    out = generate(model, encode_prompts(tokenizer, PROMPTS), cfg, on_round=answers)
    answers.finish(out)
    assert "".join(writes) == piped(tokenizer, PROMPTS, out, cfg)
    first = "".join(writes).split("\n")[1]
    assert len(first) >= 1 and sum(1 for w in writes[1:] if w and w in first) >= 2  # the first answer, in pieces


def test_the_first_answer_streams_while_the_others_wait(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cfg = CONFIGS["autoregressive"]
    writes, rounds = [], []
    answers = StreamedAnswers(tokenizer, PROMPTS, None, write=writes.append)

    def on_round(seq, rnd):
        answers(seq, rnd)
        rounds.append("".join(writes))
    out = generate(model, encode_prompts(tokenizer, PROMPTS), cfg, on_round=on_round)
    answers.finish(out)
    texts = [response_text(tokenizer, s) for s in out.sequences]
    # while the batch ran, only the first answer's text was written, and it grew round by round
    assert all(not r.count("--- [1]") for r in rounds[:-len(PROMPTS)])
    assert len({r for r in rounds}) > len(texts[0]) // 2
    assert "".join(writes) == "".join(f"{answer_header(i, p)}\n{t}\n" for i, (p, t) in enumerate(zip(PROMPTS, texts)))


def without_stats(text: str) -> str:
    """The output with each stats line reduced to its strategy (timings, and the forwards that fusing decisions
    priced by measured forward costs spend, differ from run to run)."""
    return re.sub(r"^\[(\w+) \| tokens \d+ \|.*\]$", r"[\1]", text, flags=re.M)


@pytest.mark.parametrize("strategy", ["refusion", "speculative"])
def test_generate_on_a_terminal_prints_what_it_prints_piped(tiny_model_dir, capsys, monkeypatch, strategy):
    argv = ["generate", *PROMPTS[:2], "--model", tiny_model_dir, "--dtype", "float32", "--max-new-tokens", "16",
            "--strategy", strategy, "--eos-token-id", "0", "--stats"]
    assert main(argv) == 0
    whole = capsys.readouterr().out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(argv) == 0
    streamed = capsys.readouterr().out
    assert without_stats(streamed) == without_stats(whole)
    assert without_stats(whole).count(f"[{strategy}]\n") == 2
    assert main([*argv, "--json"]) == 0  # --json on a terminal stays one object per prompt
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == PROMPTS[:2]
