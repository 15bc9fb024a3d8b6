"""Ranks on one machine split its cores between their OpenBLAS threads (`blas.share_cores`).

Each OpenBLAS starts a thread per core and its idle threads spin before sleeping, so three
ranks on two cores with two threads each ran sharded plain decoding at half the speed of
one thread each. The end-to-end check (the ranks say what they chose) is in
tests/test_distributed.py's tensor-parallel test.
"""

from __future__ import annotations

import os

import pytest

from mlxspec import blas
from mlxspec.distributed.ring import ranks_on_my_host


class FakeOpenBLAS:
    def __init__(self):
        self.threads: list[int] = []

    def openblas_set_num_threads(self, threads: int) -> None:
        self.threads.append(threads)


@pytest.fixture
def openblas(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_openblas", fake)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    return fake


def test_ranks_on_one_machine_split_its_cores(openblas):
    assert blas.share_cores(3) == 2  # 8 cores, 3 ranks: 2 threads each, none oversubscribed
    assert blas.share_cores(16) == 1  # never fewer than one
    assert openblas.threads == [2, 1]


def test_one_rank_a_machine_and_a_users_own_setting_are_left_alone(openblas, monkeypatch):
    assert blas.share_cores(1) is None
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    assert blas.share_cores(3) is None
    assert openblas.threads == []


def test_without_openblas_nothing_is_set(monkeypatch):
    monkeypatch.setattr(blas, "_openblas", None)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert blas.share_cores(3) is None


def test_the_ranks_on_a_host_are_counted_from_the_rings_addresses():
    loopback = [["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]
    assert [ranks_on_my_host(loopback, rank) for rank in range(3)] == [3, 3, 3]
    # a hostfile: two ranks on one Mac, one on another (each rank's ips, first one counts)
    hosts = [["10.0.0.1:32323", "10.0.1.1:32324"], ["10.0.0.1:32325"], ["10.0.0.2:32326"]]
    assert [ranks_on_my_host(hosts, rank) for rank in range(3)] == [2, 2, 1]
