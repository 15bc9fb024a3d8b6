"""One answer as it streams in: its text by part and provenance, and the rounds behind it.

Built from the engine's events alone (front ends never re-decode), their text read into
reasoning and answer by the shared output parser on the engine thread
(`mlxspec.markup.display`). The text is a list of segments, each of the reasoning or of
the answer, and each `accepted` (draft tokens the target agreed with), `own` (the target's
own tokens: corrections and bonus tokens) or `rejected` (drafts the target refused).
Rejected drafts are ghosts: never part of the answer, shown where they were tried (after
the round's accepted drafts, before the target's correction) and faded out after
GHOST_SECONDS unless the user keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.style import Style
from rich.text import Text

from mlxspec.events import Accepted, Bonus, Corrected, Event, Rejected, Step
from mlxspec.markup.display import Finished, Piece, Written
from mlxspec.speedup import SpeedupEstimate

ACCEPTED, OWN, REJECTED = "accepted", "own", "rejected"
KINDS = (ACCEPTED, OWN, REJECTED)
KIND_OF_EVENT = {Accepted: ACCEPTED, Corrected: OWN, Bonus: OWN}
GHOST_SECONDS = 1.5
REASONING = "reasoning"  # a saved segment's third field, where it is of the reasoning


@dataclass
class Segment:
    kind: str
    text: str
    shown_at: float = 0.0  # when a ghost appeared (time.monotonic()); saved ghosts: 0
    reasoning: bool = False


class Answer:
    def __init__(
        self,
        segments: list[Segment] | None = None,
        cancelled: bool = False,
        error: str | None = None,
        record: dict[str, Any] | None = None,
    ):
        self.segments = segments or []
        self.cancelled = cancelled
        self.error = error
        self.record = record  # the run record (RunRecord.to_dict()) once Done arrives
        self.n_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # Running totals over the rounds that drafted, for the status bar.
        self.drafted = self.accepted = self.draft_rounds = 0
        self.accepted_lengths: list[int] = []
        self.last_step: Step | None = None
        self.speedup = SpeedupEstimate()  # live, from the rounds' own plain-step costs
        self._ghost: Segment | None = None  # refused drafts waiting for their place
        self._reasoning_now = False  # the last text the engine wrote was of the reasoning
        self._live_reasoning_tokens = 0  # tokens of events that wrote reasoning, until Done

    def add(self, event: Event | Written | Finished, now: float) -> None:
        """Take one engine event (its text as the engine thread read it: Written, and
        Finished for Done); `now` (time.monotonic()) times ghosts and tokens/s."""
        if isinstance(event, Rejected):
            self._ghost = Segment(REJECTED, event.text, now)
        elif isinstance(event, Written):
            self._reasoning_now = event.reasoning
            if isinstance(event.event, Corrected):
                self._place_ghost()
            self._add_pieces(event.pieces)
            tokens = len(event.event.tokens)
            self.n_tokens += tokens
            self._live_reasoning_tokens += tokens if event.reasoning else 0
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        elif isinstance(event, Step):
            self._place_ghost()
            self.last_step = event
            self.speedup.add_round(event.accepted + 1, event.plain_steps)
            if event.drafted:
                self.drafted += event.drafted
                self.accepted += event.accepted
                self.draft_rounds += 1
                self.accepted_lengths.append(event.accepted)
        elif isinstance(event, Finished):
            self._place_ghost()
            self._add_pieces(event.pieces)
            self.record = event.answered.done.record.to_dict()

    def _add_pieces(self, pieces: tuple[Piece, ...]) -> None:
        for piece in pieces:
            self._append(KIND_OF_EVENT[piece.source], piece.text, piece.reasoning)

    def _append(self, kind: str, text: str, reasoning: bool) -> None:
        if not text:
            return
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == kind != REJECTED and last.reasoning == reasoning:
            last.text += text  # keep few segments: rendering cost grows with their number
        else:
            self.segments.append(Segment(kind, text, reasoning=reasoning))

    def _place_ghost(self) -> None:
        if self._ghost is not None:
            self._ghost.reasoning = self._reasoning_now
            self.segments.append(self._ghost)
            self._ghost = None

    def _part(self, reasoning: bool) -> str:
        return "".join(
            s.text for s in self.segments if s.kind != REJECTED and s.reasoning == reasoning
        )

    @property
    def text(self) -> str:
        """The answer itself: what the engine output, without reasoning or ghosts."""
        return self._part(reasoning=False)

    @property
    def reasoning(self) -> str:
        """What the model thought before answering (without its markers)."""
        return self._part(reasoning=True)

    @property
    def has_reasoning(self) -> bool:
        return any(s.reasoning for s in self.segments)

    @property
    def answer_started(self) -> bool:
        """The answer itself has begun (the thinking, if any, is over)."""
        return any(not s.reasoning and s.kind != REJECTED for s in self.segments)

    @property
    def reasoning_tokens(self) -> int:
        """The run record's count once done; live, the tokens of events that wrote some."""
        if self.record is not None and "reasoning_tokens" in self.record:
            return self.record["reasoning_tokens"]
        return self._live_reasoning_tokens

    @property
    def finished(self) -> bool:
        return self.record is not None or self.cancelled or self.error is not None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per round that drafted (as in the run record)."""
        return self.accepted / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """The run record's rate once done; live, tokens after the first over their time."""
        if self.record is not None:
            return self.record["tokens_per_second"]
        if self.n_tokens < 2 or self.last_token_at == self.first_token_at:
            return 0.0
        return (self.n_tokens - 1) / (self.last_token_at - self.first_token_at)

    @property
    def estimated_speedup(self) -> float:
        """Speed relative to plain decoding on this machine (see mlxspec/speedup.py):
        the run record's once done, live from the rounds so far; 0.0 before any."""
        if self.record is not None and "estimated_speedup" in self.record:
            return self.record["estimated_speedup"]
        return self.speedup.value

    def ghosts_showing(self, now: float) -> bool:
        return any(s.kind == REJECTED and now - s.shown_at < GHOST_SECONDS for s in self.segments)

    def to_text(
        self, styles: Mapping[str, Style], show_rejected: bool, now: float, reasoning=False
    ) -> Text:
        """The answer (or its reasoning) as Rich text, one style per provenance; ghosts
        while they last."""
        text = Text()
        for segment in self.segments:
            if segment.reasoning != reasoning:
                continue
            if segment.kind == REJECTED and not (
                show_rejected or now - segment.shown_at < GHOST_SECONDS
            ):
                continue
            text.append(segment.text, styles[segment.kind])
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "segments": [
                [s.kind, s.text, REASONING] if s.reasoning else [s.kind, s.text]
                for s in self.segments
            ],
            "reasoning": self.reasoning,
            "cancelled": self.cancelled,
            "error": self.error,
            "record": self.record,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Answer:
        # A message written without segments (by hand, say) shows as the target's own text.
        segments = data.get("segments") or [[OWN, data.get("content", "")]]
        return cls(
            [Segment(kind, text, reasoning=REASONING in rest) for kind, text, *rest in segments],
            cancelled=bool(data.get("cancelled")),
            error=data.get("error"),
            record=data.get("record"),
        )
