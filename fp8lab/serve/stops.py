"""Stop strings over streamed text: what may be sent, and where the text ends.

A stop string can arrive split over several text pieces, so text that could still be the start of a
stop string is held back until the next piece settles it. ``StopMatcher.push(piece)`` returns the
text that is safe to send and whether a stop string was found (the text ends just before it, as the
OpenAI API and vLLM end it; the stop string itself is never sent). ``flush()`` returns what is held
back when the sequence ends without a stop string.
"""

from __future__ import annotations


class StopMatcher:
    """Finds the first of ``stops`` (non-empty strings) in the concatenation of the pushed pieces."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: expected non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self._held = ""  # text not sent yet: it may be the start of a stop string
        self.stopped = False

    def push(self, piece: str) -> tuple[str, bool]:
        """``(text to send, stopped)`` after ``piece``; after a stop every push returns ``("", True)``."""
        if self.stopped:
            return "", True
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)], True
        keep = self._longest_partial_stop(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, when the sequence ends without a stop string."""
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
