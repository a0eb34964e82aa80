"""OpenAI's stop-string semantics on top of `llm`'s.

`llm` follows TensorRT-LLM: the matched stop string ends the output. OpenAI leaves it out. A stream
cannot take back text it has sent, so the last characters that could still turn out to be a stop
string are held back until the next delta, or the end, shows whether they are. Streamed and
non-streamed responses go through the same object, so their text is the same.
"""

from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=0)
        self.pending = ""

    def push(self, delta: str) -> str:
        """Text that can be sent now."""
        self.pending += delta
        cut = max(len(self.pending) - self.hold, 0)
        ready, self.pending = self.pending[:cut], self.pending[cut:]
        return ready

    def finish(self) -> str:
        """The held-back rest, without the stop string that ended the output, if one did."""
        rest, self.pending = self.pending, ""
        for s in sorted(self.stops, key=len, reverse=True):  # of "ab" and "b", "ab" matched first
            if rest.endswith(s):
                return rest[: -len(s)]
        return rest
