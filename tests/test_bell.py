"""Rank 0's doorbell (`mlxspec.distributed.bell`): every ring wakes one wait of each
follower, a follower with nothing rung stays asleep, and a rank 0 that is gone wakes it
for good. Sockets on loopback only; the end-to-end check (an idle sharded server's
followers take next to no CPU) is in tests/test_rank_relay.py."""

from __future__ import annotations

import threading

import pytest

from mlxspec.distributed import bell


def pair(followers: int = 2):
    """Rank 0's Bell and each follower's, as `RankSession._open_bell` connects them."""
    server = bell.listen("127.0.0.1")
    port = server.getsockname()[1]
    mine = [bell.connect("127.0.0.1", port) for _ in range(followers)]
    connections = bell.accept(server, followers)
    assert connections is not None and all(mine)
    return bell.Bell(connections), [bell.Bell([connection]) for connection in mine]


def waits_within(follower: bell.Bell, seconds: float) -> bool:
    """Whether `follower.wait()` returns within `seconds`."""
    done = threading.Event()
    threading.Thread(target=lambda: (follower.wait(), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_each_ring_wakes_one_wait_of_every_follower():
    front, followers = pair()
    for _ in range(3):
        front.ring()
    for follower in followers:
        assert all(waits_within(follower, 5) for _ in range(3))
        assert not waits_within(follower, 0.3)  # nothing more was rung: it sleeps
    front.ring()  # the one still waiting wakes
    front.close()


def test_a_follower_whose_rank_0_is_gone_waits_no_more():
    front, [follower] = pair(1)
    front.close()
    assert waits_within(follower, 5)
    assert follower.connections == []
    assert waits_within(follower, 1)  # from now on the collective alone decides


def test_a_missing_follower_means_no_bell(monkeypatch):
    monkeypatch.setattr(bell, "CONNECT_SECONDS", 0.3)
    server = bell.listen("127.0.0.1")
    mine = bell.connect("127.0.0.1", server.getsockname()[1])
    assert bell.accept(server, 2) is None  # one of two connected: every rank goes without
    mine.close()


@pytest.mark.parametrize("host", ["203.0.113.1"])  # TEST-NET-3: not this machine's
def test_an_address_that_is_not_here_gives_no_listener(host):
    assert bell.listen(host) is None
