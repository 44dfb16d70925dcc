"""The text of a completion as its token ids arrive: stop strings, hold-back, text deltas.

One mechanism serves every place that turns streamed token ids into text: both backends (to
find stop strings and cut the ids before the token in which one begins, and to stream only
tokens no stop string can begin in) and the gateway (to send text deltas that never change
once sent, holding back a tool-call tag or anything that may start one).

The whole prefix is decoded each time (with skip_special_tokens, as vLLM matches stop strings),
so multi-byte characters and merges come out right. A character whose bytes are not all
generated yet decodes as U+FFFD: it counts in a token's text length (so a cut never keeps
partial bytes of a stop string) but not in the text searched or shown (it is not that
character yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

_PARTIAL = "\ufffd"


class IncrementalText:
    """Token ids pushed as they come; what they say, where a stop string cut them, what is safe.

    - `stops`: stop strings. `push` reports the first one to appear, as the number of tokens
      to keep (those before the token in which it begins).
    - `hold`: hold-back markers (a tool-call tag). Text from a marker on is held back, and so
      is a suffix that may be the beginning of one (or of a stop string).
    - `hold_all`: nothing is safe before the end (a format whose markers can start anywhere).
    """

    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[str] = (),
        hold: Sequence[str] = (),
        hold_all: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = [m for m in hold if m]
        self.hold_all = hold_all
        self.token_ids: list[int] = []
        #: Tokens to keep, once a stop string appeared (None: none yet).
        self.stopped: int | None = None
        #: The stop string that appeared first, once one did.
        self.stop: str | None = None
        #: Characters of text handed out by `take`.
        self.sent = 0
        self._decoded = ""
        # Length of the decoded text of the first k + 1 tokens, partial characters included;
        # None until needed (a push of several tokens decodes only the whole).
        self._ends: list[int | None] = []

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def push(self, token_ids: Iterable[int]) -> int | None:
        """Append tokens; if a stop string appeared in them, the number of tokens to keep."""
        new = list(token_ids)
        if not new:
            return None
        searched = len(self._shown())
        self.token_ids.extend(new)
        self._ends.extend([None] * len(new))
        self._decoded = self._decode(self.token_ids)
        self._ends[-1] = len(self._decoded)
        if self.stopped is not None or not self.stops:
            return None
        text = self._shown()
        # Only a match ending in the new text is new; earlier ones were found earlier.
        starts = [
            (found, stop)
            for stop in self.stops
            if (found := text.find(stop, max(0, searched - len(stop) + 1))) >= 0
        ]
        if not starts:
            return None
        start, self.stop = min(starts, key=lambda found: found[0])
        self.stopped = self._tokens_within(start)
        return self.stopped

    def text(self) -> str:
        """The decoded text of every token pushed (a trailing partial character included)."""
        return self._decoded

    def _shown(self) -> str:
        return self._decoded.rstrip(_PARTIAL)

    def safe_length(self) -> int:
        """How much of the text can be shown: what no later token can change, no stop string
        or marker can begin in, and no marker has begun before."""
        if self.hold_all:
            return 0
        text = self._shown()
        safe = len(text)
        for marker in self.hold:
            found = text.find(marker)
            if found >= 0:
                safe = min(safe, found)
        for string in (*self.stops, *self.hold):
            for size in range(min(len(string) - 1, len(text)), 0, -1):
                if text.endswith(string[:size]):
                    safe = min(safe, len(text) - size)
                    break
        return safe

    def ready_tokens(self) -> int:
        """How many leading tokens can be streamed: those whose text lies within the safe text."""
        return self._tokens_within(self.safe_length())

    def take(self) -> str:
        """The safe text not taken before."""
        safe = self.safe_length()
        if safe <= self.sent:
            return ""
        delta, self.sent = self._decoded[self.sent : safe], safe
        return delta

    def rest(self) -> str:
        """Everything not taken yet, held-back text and partial characters included (at the end)."""
        return self._decoded[self.sent :]

    def _tokens_within(self, position: int) -> int:
        """The most leading tokens whose text ends at or before `position`."""
        n = len(self.token_ids)
        while n > 0 and self._end(n - 1) > position:
            n -= 1
        return n

    def _end(self, k: int) -> int:
        end = self._ends[k]
        if end is None:
            end = self._ends[k] = len(self._decode(self.token_ids[: k + 1]))
        return end
