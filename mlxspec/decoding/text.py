"""Incremental text for the event stream: per-token pieces, stop strings, hold-back.

Each output token gets the exact piece of text it added (via mlx-lm's streaming
detokenizer, so multi-byte characters split across tokens come out whole). Text that
might be the start of a stop string is held back until it is known not to be, so a
stop string is never shown, even when it spans two verify rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer


@dataclass
class Piece:
    kind: str  # "accepted" | "corrected" | "bonus"
    token: int
    text: str


def keeping_leading_space(detokenizer):
    """mlx-lm's streaming detokenizers drop the first piece's leading space, as when a whole
    text is decoded from its start; a generation continues its prompt, where that space is
    the model's own: " Paris" after "The capital is", the indentation a completion writes
    at the cursor (llama.cpp keeps it too)."""
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        detokenizer._maybe_trim_space = lambda text: text
    elif isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    return detokenizer


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), min_indent: int = 0):
        """`min_indent`: inline completion's end of a block (llama.cpp's `n_indent`): a line
        after the first that starts less indented ends the text where its code begins."""
        self.detokenizer = keeping_leading_space(tokenizer.detokenizer)
        self.detokenizer.reset()
        self.stop = [s for s in stop if s]
        self.min_indent = min_indent
        self.text = ""  # all text so far, held-back part included
        self.released = 0  # characters already handed out
        self._pending: list[Piece] = []
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self.limit: str | None = None  # "indent" where the indentation ended it

    @property
    def stopped(self) -> bool:
        return self.matched is not None or self.limit is not None

    def add(self, kind: str, token: int) -> None:
        self.detokenizer.add_token(token)
        segment = self.detokenizer.last_segment
        self.text += segment
        self._pending.append(Piece(kind, token, segment))

    def finish(self) -> None:
        """No more tokens: flush what the detokenizer still holds."""
        self.detokenizer.finalize()
        tail = self.detokenizer.last_segment
        if tail:
            self.text += tail
            if self._pending:
                self._pending[-1].text += tail
            else:
                self._pending.append(Piece("bonus", -1, tail))

    def release(self, final: bool = False) -> list[Piece]:
        """Pieces that can be shown now; sets `matched` when a stop string appeared (the
        one that starts first, which an API may report: Anthropic's `stop_sequence`)."""
        cut = len(self.text)
        for stop in self.stop:
            found = self.text.find(stop, max(0, self.released - len(stop) + 1))
            if found != -1 and found < cut:
                cut, self.matched = found, stop
        dedent = self._dedent()
        if dedent is not None and dedent < cut:
            cut, self.matched, self.limit = dedent, None, "indent"
        if not self.stopped and not final:
            cut -= self._held_back()
        out, position = [], self.released
        while self._pending and position + len(self._pending[0].text) <= cut:
            piece = self._pending.pop(0)
            position += len(piece.text)
            out.append(piece)
        if self.stopped and self._pending and position < cut:
            # The stop string starts inside this token: keep only the text before it, and
            # not the token itself (it carries the start of the stop string).
            piece = self._pending.pop(0)
            piece.text, piece.token = piece.text[: cut - position], -1
            position = cut
            out.append(piece)
        if self.stopped:
            self._pending.clear()
            self.text = self.text[:cut]
        self.released = position
        return out

    def _dedent(self) -> int | None:
        """Where the first line after the first that is indented less than `min_indent`
        has its code begin (None: no such line yet; a line of only blanks is not judged)."""
        if self.min_indent <= 0:
            return None
        # Lines that ended before what was released were judged then.
        start = self.text.rfind("\n", 0, self.released + 1)
        if start == -1:
            start = self.text.find("\n")
        while start != -1:
            code = start + 1
            while code < len(self.text) and self.text[code] in " \t":
                code += 1
            if code < len(self.text) and self.text[code] != "\n":
                if code - start - 1 < self.min_indent:
                    return code
            start = self.text.find("\n", start + 1)
        return None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
