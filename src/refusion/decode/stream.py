"""Streamed text: a response's committed tokens, turned into text that is never taken back.

Every front end that streams (the server's scheduler, `refusion generate` on a terminal, `refusion chat`) decodes
the committed contiguous prefix of a response (`Sequence.contiguous_response`) after each round and sends only what
`TextStream.update` returns: the new, stable end of the text. Decoding the whole prefix each time, rather than
token by token, lets the tokenizer join byte pieces and spaces as it does for the final text; a trailing U+FFFD (a
multi-byte character whose bytes are not all committed yet) is held back until its last byte arrives, so a
character split across tokens never prints broken.

How far a stream gets each round depends on the strategy: AR and the exact mode commit left to right, so the whole
committed response streams; plan and infill commits slots anywhere in the block, and only the prefix before the
first masked position streams (it jumps when the gap fills).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger("refusion.stream")


class TextStream:
    """Turns the growing decoded text of one sequence into deltas that are never taken back.

    A delta holds back (a) a trailing U+FFFD, i.e. an incomplete multi-byte character, and (b) a tail that
    could be the start of a stop string. A stop string cuts the text before it and ends the stream.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = ""

    def update(self, text: str, final: bool) -> tuple[str, bool]:
        """(delta to send, whether a stop string matched) for the text decoded so far."""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        stopped = cut >= 0
        if stopped:
            text, final = text[:cut], True
        if not final:
            text = text[: len(text) - self._held_back(text)]
        if not text.startswith(self.sent):
            log.warning("decoded text is not an extension of the text already streamed; %r after %r",
                        text, self.sent)
            return "", stopped
        delta, self.sent = text[len(self.sent):], max(text, self.sent, key=len)
        return delta, stopped

    def _held_back(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold


def response_text(tokenizer, tokens: Sequence[int]) -> str:
    """The text of response ids as `refusion generate` and `refusion chat` print it (special tokens left out)."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


class ResponseStream:
    """One response's text, written as its tokens are committed.

    `update(tokens)` takes the committed contiguous response (each round) and writes what is new and stable;
    `finish(tokens)` takes the whole response and writes the rest. Together they write `response_text(tokens)`.
    """

    def __init__(self, tokenizer, write: Callable[[str], object]):
        self.tokenizer, self.write = tokenizer, write
        self.text = TextStream([])
        self.seen = 0  # how many committed tokens the last update decoded

    def update(self, tokens: Sequence[int]) -> None:
        if len(tokens) == self.seen:
            return  # nothing new reached the contiguous prefix this round
        self.seen = len(tokens)
        delta, _ = self.text.update(response_text(self.tokenizer, tokens), final=False)
        if delta:
            self.write(delta)

    def finish(self, tokens: Sequence[int]) -> str:
        """Write the rest of the response; return its whole text."""
        text = response_text(self.tokenizer, tokens)
        delta, _ = self.text.update(text, final=True)
        if delta:
            self.write(delta)
        return text

    @property
    def written(self) -> str:
        """The text written so far."""
        return self.text.sent
