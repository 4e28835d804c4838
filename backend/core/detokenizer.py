"""Token ids to text, one token at a time, with stop strings.

Decoding a single token alone loses leading spaces (SentencePiece) and splits multi-byte
characters (byte-level BPE). So the text of the last few tokens is decoded with and without the
new one, and only the difference is appended, once it no longer ends in a broken character.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string that now ends the text, if any (text cut before it)."""
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        # A stop string can start up to max_stop_len - 1 characters before the new text.
        window_start = max(0, old_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def flush(self) -> None:
        """At the end: keep whatever a broken trailing character left undecoded."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.text += full[len(prefix) :]
        self.read_offset = len(self.ids)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back a tail that may still become a stop string."""
        if finished or not self.max_stop_len:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]
