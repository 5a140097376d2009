"""Streamed text deltas: never taken back, stop strings cut, incomplete characters held back."""

from __future__ import annotations

from refusion.decode.stream import TextStream


def feed(stops, texts):
    """Deltas for a growing text (the last one final), and whether a stop string matched."""
    stream, deltas, stopped = TextStream(stops), [], False
    for i, text in enumerate(texts):
        delta, stopped = stream.update(text, final=i == len(texts) - 1)
        deltas.append(delta)
        if stopped:
            break
    return deltas, stopped


def test_deltas_concatenate_to_the_text():
    deltas, stopped = feed([], ["he", "hell", "hello", "hello world"])
    assert deltas == ["he", "ll", "o", " world"] and not stopped


def test_a_possible_stop_prefix_is_held_back_then_released():
    deltas, stopped = feed(["END"], ["ab", "abE", "abEN", "abENx", "abENxy"])
    assert deltas == ["ab", "", "", "ENx", "y"] and not stopped


def test_stop_string_cuts_before_it_and_ends():
    deltas, stopped = feed(["END", "zz"], ["ab", "abEN", "abENDcd", "never seen"])
    assert "".join(deltas) == "ab" and stopped and len(deltas) == 3


def test_stop_string_arriving_whole_in_one_update():
    assert feed(["\n\n"], ["a", "a\n\nb"]) == (["a", ""], True)


def test_incomplete_character_is_held_back():
    deltas, _ = feed([], ["caf", "caf\ufffd", "café", "café!"])
    assert deltas == ["caf", "", "é", "!"]


def test_final_text_is_sent_whole():
    assert feed(["xyz"], ["ab", "abxy"]) == (["ab", "xy"], False)


def byte_tokenizer():
    """A byte-level tokenizer (one token per UTF-8 byte), built offline: a character of several bytes spans tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_response_stream_never_writes_a_broken_character():
    from refusion.decode.stream import ResponseStream, response_text

    tokenizer = byte_tokenizer()
    text = "café ☕ 東京"
    tokens = tokenizer(text)["input_ids"]
    assert len(tokens) == len(text.encode("utf-8")) > len(text)  # the test splits characters across tokens
    writes = []
    stream = ResponseStream(tokenizer, writes.append)
    for n in range(1, len(tokens) + 1):  # one more committed token each round
        stream.update(tokens[:n])
    assert stream.finish(tokens) == text == response_text(tokenizer, tokens)
    assert "".join(writes) == text and not any("\ufffd" in w for w in writes)
    assert "é" in writes and "☕" in writes and len(writes) == len(text)  # each character once it is whole


def test_response_stream_writes_the_rest_at_finish():
    from refusion.decode.stream import ResponseStream

    tokenizer = byte_tokenizer()
    tokens = tokenizer("ok é")["input_ids"]
    writes = []
    stream = ResponseStream(tokenizer, writes.append)
    stream.update(tokens[:-1])  # the last byte of é is not committed yet
    stream.update(tokens[:-1])  # nothing new: nothing decoded or written
    assert writes == ["ok "]
    stream.finish(tokens)
    assert writes == ["ok ", "é"]
