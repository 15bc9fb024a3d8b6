"""A streaming client that waits in line: its headers at once, SSE comments while it waits.

A real uvicorn server on the tiny llamas of test_server, its only slot held by a long
stream: a second stream, in every dialect, gets 200 and `: waiting in queue, N ahead`
comments before its first token, and the official SDKs read the answer through them.
A refusal stays a real status.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest
from test_server import CHAT, ECHO, TEXT, TinyProvider, direct_answer

from mlxspec.events import OUTPUT_EVENTS
from mlxspec.server import ServerLimits, answering, create_app
from mlxspec.server.background import serving_in_thread

COMMENT_SECONDS = 0.2
MESSAGES = [{"role": "user", "content": ECHO}]
HOLD = "hold the slot"
HELD_AFTER = 4  # outputs
# The tiny llama answers this one for 3,000 tokens (put first, the hold ends its answer at 3).
HOLDING = [{"role": "user", "content": f"{ECHO} ({HOLD})"}]
# (path, a streamed request's body, the line that ends its stream)
DIALECTS = {
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 8, "stream": True}, "data: [DONE]"),
    "completions": (TEXT, {"prompt": ECHO, "max_tokens": 8, "stream": True}, "data: [DONE]"),
    "messages": (
        "/v1/messages",
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": True},
        "event: message_stop",
    ),
    "responses": (
        "/v1/responses",
        {"model": "tiny", "input": ECHO, "max_output_tokens": 8, "stream": True},
        "event: response.incomplete",  # max_output_tokens reached
    ),
}


class Server:
    """A server on the tiny llamas whose slots a holder can keep: the generation thread
    stops after relaying an output of the holders' once `slots` of them run, until
    `release`; the queue has room for one request (a second is refused)."""

    def __init__(self, url: str, slots: int, worker):
        self.url, self.slots, self.gate = url, slots, threading.Event()
        self.gate.set()
        self._outputs: dict[object, int] = {}  # a holder's job -> its outputs relayed
        relay = worker._relay

        def gated(job, event) -> None:
            relay(job, event)
            holder = HOLD in str(job.generation.prompt)
            if holder and isinstance(event, OUTPUT_EVENTS) and not self.gate.is_set():
                # A few outputs, so that its client has a chunk (the parser may hold one).
                self._outputs[job] = self._outputs.get(job, 0) + 1
                if sum(n >= HELD_AFTER for n in self._outputs.values()) >= self.slots:
                    self.gate.wait(30)
                else:  # slow, so that it is still running when the next holder joins
                    time.sleep(0.02)

        worker._relay = gated

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Every slot taken by a long stream (its first chunk in) until the block ends."""
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=60)
        streams = []
        self._outputs.clear()
        self.gate.clear()
        try:
            for _ in range(self.slots):
                stream = client.chat.completions.create(
                    model="tiny", messages=HOLDING, max_tokens=3000, temperature=0, stream=True
                )
                next(iter(stream))
                streams.append(stream)
            yield
        finally:
            self.gate.set()
            for stream in streams:
                stream.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-at-a-time", "batched"])
def server(request) -> Iterator[Server]:
    slots = request.param
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answering, "WAIT_COMMENT_SECONDS", COMMENT_SECONDS)
        app = create_app(
            TinyProvider(), limits=ServerLimits(max_batch=slots, max_waiting=1), preload="tiny"
        )
        with serving_in_thread(app) as url:
            server = Server(url, slots, app.state.worker)
            yield server
            server.gate.set()


def wait_for_queued(url: str, request: Future | None = None) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").json()["waiting"] < 1:
        if request is not None and request.done():
            request.result()  # its error
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.01)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_waiting_stream_gets_its_headers_at_once_and_comments_until_it_starts(server, dialect):
    url = server.url
    path, body, last = DIALECTS[dialect]
    lines: list[str] = []
    with server.holding(), httpx.Client(timeout=httpx.Timeout(5, read=3)) as client:
        with client.stream("POST", url + path, json=body) as response:
            assert response.status_code == 200  # the headers came while the slot was held
            assert response.headers["content-type"].startswith("text/event-stream")
            # A refusal, while this one waits, is still a status, not a stream.
            refused = client.post(url + path, json=body)
            assert refused.status_code == 429 and "Retry-After" in refused.headers
            waited = time.monotonic()
            lines_read = response.iter_lines()
            while len([line for line in lines if line.startswith(":")]) < 3:
                lines.append(next(lines_read))
            assert time.monotonic() - waited >= COMMENT_SECONDS  # one every few seconds
            assert not [line for line in lines if line and not line.startswith(":")]
            assert lines[0] == ": waiting in queue, 1 ahead"
    # The holders let go: this client was only waiting.
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + path, json=body) as response:
            assert response.status_code == 200
            assert last in list(response.iter_lines())


def test_comments_stop_when_the_model_is_at_work_and_the_stream_ends_whole(server):
    """The waiting stream goes on after its holder leaves, its comments all before its
    first event, and ends as a stream that never waited would."""
    url = server.url
    path, body, last = DIALECTS["chat"]
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(1) as pool:
        with server.holding():
            response = client.send(client.build_request("POST", url + path, json=body), stream=True)
            assert response.status_code == 200
            lines = pool.submit(lambda: list(response.iter_lines()))
            wait_for_queued(url)
            time.sleep(3 * COMMENT_SECONDS)
        read = lines.result(timeout=30)
        response.close()
    comments = [i for i, line in enumerate(read) if line.startswith(":")]
    events = [i for i, line in enumerate(read) if line.startswith("data:")]
    assert len(comments) >= 2 and max(comments) < min(events)
    assert read[events[-1]] == last


def test_the_sdks_read_a_stream_that_waited(server):
    url = server.url
    expected = direct_answer(MESSAGES, 8)
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=30)
    messages = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=30)

    def openai_text() -> str:
        stream = chat.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    def anthropic_text() -> str:
        with messages.messages.stream(
            model="tiny", messages=MESSAGES, max_tokens=8, extra_body={"temperature": 0}
        ) as stream:
            return "".join(stream.text_stream)

    def responses_text() -> str:
        stream = chat.responses.create(
            model="tiny", input=MESSAGES, max_output_tokens=8, stream=True
        )
        return "".join(
            event.delta for event in stream if event.type == "response.output_text.delta"
        )

    for read in (openai_text, anthropic_text, responses_text):
        with ThreadPoolExecutor(1) as pool:
            with server.holding():
                answer = pool.submit(read)
                wait_for_queued(url, answer)
                time.sleep(3 * COMMENT_SECONDS)  # comments arrive before the first event
            assert answer.result(timeout=30) == expected, read.__name__


def test_a_stream_with_nobody_ahead_still_gets_its_errors_as_a_status(server):
    url = server.url
    too_long = {"messages": [{"role": "user", "content": "x" * 5000}], "stream": True}
    response = httpx.post(url + CHAT, json=too_long, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_a_stream_that_must_wait_is_refused_a_prompt_too_long_with_a_status(server):
    """Queued behind every slot, a prompt past the resident model's context is still a
    400 context_length_exceeded (checked before the headers), not an event after them."""
    too_long = {"messages": [{"role": "user", "content": "x" * 5000}], "stream": True}
    with server.holding():
        response = httpx.post(server.url + CHAT, json=too_long, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(f"{server.url}/health").json()["waiting"] == 0  # not left queued


def test_a_stream_waiting_when_the_server_stops_hears_why_as_its_last_event():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answering, "WAIT_COMMENT_SECONDS", COMMENT_SECONDS)
        app = create_app(TinyProvider(), limits=ServerLimits(max_waiting=1), preload="tiny")
        with serving_in_thread(app) as url:
            server = Server(url, 1, app.state.worker)
            path, body, _ = DIALECTS["chat"]
            with server.holding(), httpx.Client(timeout=10) as client:
                with client.stream("POST", url + path, json=body) as response:
                    assert response.status_code == 200
                    lines = response.iter_lines()
                    assert next(lines).startswith(": waiting in queue")
                    app.state.worker.shutdown(grace=5)
                    events = [line for line in lines if line.startswith("data: ")]
            assert len(events) == 1 and '"shutting_down"' in events[0], events
