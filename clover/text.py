"""Text at the edge: stop strings and detokenizing, for the decoder, the in-flight batcher and the CLI.

* :func:`cut_at_stop`: text up to the earliest stop string; :func:`stop_search_start` bounds each search to the
  new text (docs/serving.md#shutdown-faults-and-security).
* :class:`StopFinder`: the decoder's per-sequence search for the token count where a stop string ends.
* :class:`TextStream`: incremental detokenization whose deltas never need to be taken back (a possible start
  of a stop string and a partial character are held back until settled).

Low level: it imports nothing of the decoder or the server.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

# characters at the end of the text searched before that a tokenizer may still revise (a partial UTF-8
# character decoded as U+FFFD, a merged space) and are searched again
_STOP_REVISION_CHARS = 8


def cut_at_stop(text: str, stop_strings: Iterable[str], start: int = 0) -> str:
    """``text`` up to (not including) the earliest stop string in it; empty stop strings never match.

    ``start``: search only from there (see :func:`stop_search_start`), so the cost per decode step does not
    grow with the text already searched (docs/serving.md#shutdown-faults-and-security).
    """
    starts = [found for found in (text.find(stop, start) for stop in stop_strings if stop) if found >= 0]
    return text[: min(starts)] if starts else text


def stop_search_start(searched_chars: int, stop_strings: Iterable[str]) -> int:
    """Where to search for stop strings in text that grew from ``searched_chars`` characters, already searched:
    a stop string ending in the new text starts at most its length (less one) before it."""
    longest = max((len(stop) for stop in stop_strings), default=0)
    return max(0, searched_chars - longest - _STOP_REVISION_CHARS)


def stop_prefix_held(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a stop string (text that may yet
    become one); only candidate positions where a stop string's first character occurs are compared."""
    hold = 0
    for stop in stop_strings:
        if not stop:
            continue
        tail = text[len(text) - min(len(stop) - 1, len(text)):]
        at = tail.find(stop[0])
        while 0 <= at and len(tail) - at > hold:
            if stop.startswith(tail[at:]):
                hold = len(tail) - at
                break
            at = tail.find(stop[0], at + 1)
    return hold


def answer_text(decode: Callable[..., str], token_ids: Sequence[int], stop_strings: Iterable[str]) -> str:
    """The text of a whole answer: its tokens decoded without special tokens, cut before the first stop string
    (:attr:`clover.decode.SequenceResult.text`; :class:`TextStream`'s deltas add up to it)."""
    return cut_at_stop(decode(list(token_ids), skip_special_tokens=True), stop_strings)


class StopFinder:
    """Finds where a stop string ends in a growing answer, in tokens: the decoder keeps one per sequence.

    ``decode(token_ids) -> str`` is the tokenizer's. Each :meth:`cut` searches only the text the new tokens
    may have changed (:func:`stop_search_start`), so its cost does not grow with the answer.
    """

    def __init__(self, decode: Callable[..., str], stop_strings: Iterable[str]) -> None:
        self.decode = decode
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._searched = 0  # characters of the answer's text already searched

    def cut(self, token_ids: Sequence[int], checked: int) -> int | None:
        """The smallest token count > ``checked`` (the tokens searched before, whose text had none) whose text
        holds a stop string, or None when the text of all ``token_ids`` holds none."""
        start = stop_search_start(self._searched, self.stop_strings)
        text = self.decode(list(token_ids))
        if cut_at_stop(text, self.stop_strings, start) == text:
            self._searched = len(text)
            return None
        for n in range(max(1, checked), len(token_ids) + 1):
            prefix = self.decode(list(token_ids[:n]))
            if cut_at_stop(prefix, self.stop_strings, start) != prefix:
                return n
        return len(token_ids)


class TextStream:
    """Incremental detokenization whose deltas never need to be taken back.

    The whole answer is decoded each time (``skip_special_tokens``), cut before
    the first stop string; until the answer is finished, a trailing partial
    character (U+FFFD) and a tail that could be the start of a stop string are
    held back. The concatenated deltas equal :func:`answer_text` (the decoder's
    :attr:`clover.decode.SequenceResult.text`). Text the tokenizer revises after
    it was sent stays as sent. Stop strings are searched in the new text's
    window only, so a step's matching cost is bounded by the stop strings, not
    the answer's length.
    """

    def __init__(self, tokenizer, stop_strings: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.token_ids: list[int] = []
        self.sent = ""
        self._searched = 0  # characters of the decoded answer already searched for stop strings

    def push(self, token_ids: Iterable[int], finished: bool) -> str:
        """Add new tokens; returns the text that is now settled and was not returned before."""
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        whole = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        text = cut_at_stop(whole, self.stop_strings, stop_search_start(self._searched, self.stop_strings))
        self._searched = len(whole)
        if not finished:
            text = text[: len(text) - stop_prefix_held(text, self.stop_strings)]
            while text.endswith("\ufffd"):
                text = text[:-1]
        if not text.startswith(self.sent):
            return ""  # the tokenizer revised earlier text; what was sent stays
        delta, self.sent = text[len(self.sent):], text
        return delta
