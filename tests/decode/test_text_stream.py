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
