"""Stop strings over a stream of text deltas.

Algorithm. Keep the text not yet emitted (`pending`). On each delta, append it and look for a
complete stop string in `pending`; if one is there, emit the text before it (plus the stop string
when include_stop_str_in_output) and stop. Otherwise hold back the longest suffix of `pending`
that is a prefix of some stop string -- it may become a stop string with the next delta, so it
must not reach the user yet -- and emit the rest. `pending` is thus always shorter than the
longest stop string plus one delta, so a feed costs O(len(delta) + total stop length^2).

Which stop wins when several match: the one whose occurrence ends first (the first the text
completes), and among those the one that starts first. This does not depend on how the text is
cut into deltas: feeding it one character at a time would stop at the same place.
"""

from __future__ import annotations

from splitserve.platform.errors import InvalidRequestError


class StopStringMatcher:
    """Owns one request's held-back text; `feed` and `flush` are its only writers."""

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool = False):
        if any(not isinstance(stop, str) or not stop for stop in stops):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self._stops = tuple(stops)
        self._include_stop = include_stop_str_in_output
        self._pending = ""
        self._matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self._matched_stop is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched_stop

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return (text safe to emit now, whether a stop string hit).
        After a stop, further deltas are ignored: ("", True)."""
        if self.stopped:
            return "", True
        self._pending += delta
        match = self._first_match()
        if match is not None:
            start, stop = match
            emit = self._pending[:start] + (stop if self._include_stop else "")
            self._pending, self._matched_stop = "", stop
            return emit, True
        num_held = self._num_held_chars()
        cut = len(self._pending) - num_held
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        return emit, False

    def flush(self) -> str:
        """Release the held-back text when generation ends for another reason (length, EOS)."""
        emit, self._pending = self._pending, ""
        return emit

    def _first_match(self) -> tuple[int, str] | None:
        best = None  # (end, start, stop)
        for stop in self._stops:
            start = self._pending.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_held_chars(self) -> int:
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        text, held = self._pending, 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
