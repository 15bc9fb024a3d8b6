"""What every launched process does: join the group, load and shard the target, agree
with rank 0 on each request, run the unchanged speculative loop, and check after every
round that all ranks still hold the same cache.

Every rank runs the same deterministic proposer over the same tokens and the same verify
pass. Two things could still make ranks disagree and are pinned to rank 0's choice: the
adaptive draft length (it depends on each rank's own timings) and the verify-cost
calibration. A per-round all_gather of [cache offset, cached tokens, drafted, accepted,
hash of the last tokens] catches any rank that drifts anyway.

A server's batch (`serve --max-batch`) runs differently: the other ranks run no engine
loop, they replay the cache work of rank 0's batch (`mlxspec.distributed.batch`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from functools import partial

import mlx.core as mx

from mlxspec import blas
from mlxspec.decoding.engine import Engine, GenerationError, GenerationSettings
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.verify_cost import (
    VerifyCost,
    cached_verify_cost,
    calibration_key,
    measure_verify_cost,
    pooled_monotone,
)
from mlxspec.distributed import bell
from mlxspec.distributed.batch import PLAN, BatchFollower, batches
from mlxspec.distributed.collectives import Collectives
from mlxspec.distributed.config import FAULT_ENV, RankConfig
from mlxspec.distributed.errors import DistributedError
from mlxspec.distributed.ring import ranks_on_my_host
from mlxspec.distributed.sharding import allreduces_per_forward, fingerprint, shard
from mlxspec.distributed.watchdog import Watchdog
from mlxspec.events import Done, Event, Step
from mlxspec.markup.conversation import Conversation
from mlxspec.models.kv_form import FLOAT
from mlxspec.models.prompt_cache import PromptCache
from mlxspec.sampling import SamplingSettings
from mlxspec.structured.grammar import Grammar

# Every rank runs the calibration's passes (rank 0's timings are kept): more of them, and
# a fit that averages a slow timing away instead of carrying it to every larger size. No
# time budget: each rank's clock would stop it after different passes, and every pass is
# a collective that all ranks must run.
SHARDED_CALIBRATION = {"repeats": 8, "fit": pooled_monotone, "budget": None}
CHECK_FIELDS = ("cache offset", "cached tokens", "drafted", "accepted", "last-tokens hash")


class AgreedPolicy(Policy):
    """The adaptive policy, with every rank taking rank 0's draft length (and, in a chain,
    its member): a rank's own choice depends on its own timings, and ranks must run
    verify passes of one shape."""

    def __init__(self, inner: Policy, collectives: Collectives):
        super().__init__(**{f: getattr(inner, f) for f in inner.__dataclass_fields__})
        self.collectives = collectives

    def choose_among(self, situations, limit: int):
        """Rank 0's pick of chain member and draft length (`choose` goes through here)."""
        situation, k = super().choose_among(situations, limit)
        if self.fixed_k is not None or not situations:
            return situation, k  # the same on every rank already
        index = situations.index(situation) if situation in situations else 0
        index, k = self.collectives.broadcast_ints([index, k], "agreeing on the draft length")
        return situations[index], k


# Prompt caches each rank keeps (by count: see `open_runtime`).
RANK_PROMPT_CACHES = 8


class RankEngine(Engine):
    """The engine, with the two timing-dependent choices pinned to rank 0."""

    collectives: Collectives
    cost_key: str

    def kept_policy(self, proposer, fixed_k):
        policy = super().kept_policy(proposer, fixed_k)
        if not isinstance(policy, AgreedPolicy):
            key = next(k for k, v in self._policies.items() if v is policy)
            policy = self._policies[key] = AgreedPolicy(policy, self.collectives)
        return policy

    @property
    def verify_cost(self) -> VerifyCost:
        """Calibrated by all ranks together (the sharded forward is a collective), kept as
        rank 0 measured it, and cached apart from the one-process calibration."""
        if self._verify_cost is None:
            self._verify_cost = self._agreed_verify_cost()
        return self._verify_cost

    def _agreed_verify_cost(self) -> VerifyCost:
        col = self.collectives

        def measure() -> VerifyCost:
            col.broadcast_ints([1], "calibrating")
            col.watchdog.disarm()  # many forward passes; each is its own collective
            self.notify("measuring verify cost of the sharded model (once per setup)")
            return measure_verify_cost(self.target.model, self.vocab_size, **SHARDED_CALIBRATION)

        if col.rank == 0:
            measured = []
            cost = cached_verify_cost(self.cost_key, lambda: measured.append(1) or measure())
            if not measured:
                col.broadcast_ints([0], "calibrating")
            col.broadcast_json(cost.to_json(), "sharing the calibration")
            return cost
        if col.broadcast_ints([0], "calibrating")[0]:
            col.watchdog.disarm()  # many forward passes; each is its own collective
            measure_verify_cost(self.target.model, self.vocab_size, **SHARDED_CALIBRATION)
        return VerifyCost.from_json(col.broadcast_json(None, "sharing the calibration"))


def _ring_addresses() -> list[list[str]] | None:
    """Every rank's ip:port list, from the ring's address file (None where there is none
    to read: another backend, or one rank)."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as file:
            addresses = json.load(file)
    except (KeyError, OSError, ValueError):
        return None
    ok = isinstance(addresses, list) and all(
        isinstance(ips, list) and ips and all(isinstance(ip, str) for ip in ips)
        for ips in addresses
    )
    return addresses if ok and addresses else None


class RankSession:
    """This process's place in the group and the collectives it runs with the others."""

    def __init__(self, config: RankConfig):
        self.config = config
        addresses = _ring_addresses()  # read before the file goes (`Ring.forget`)
        self.group = mx.distributed.init(strict=True, backend=config.backend)
        self.rank, self.size = self.group.rank(), self.group.size()
        if addresses and len(addresses) != self.size:
            addresses = None  # not this group's file
        self.blas_threads = blas.share_cores(
            ranks_on_my_host(addresses, self.rank) if addresses else 1
        )
        self.front_host = addresses[0][0].rsplit(":", 1)[0] if addresses else ""  # rank 0's
        self.watchdog = Watchdog(config.timeout, self.rank)
        self.collectives = Collectives(self.group, self.watchdog)
        self.allreduce_seconds = 0.0
        self.allreduces = 0
        self.rounds = 0
        self._fault = _parse_fault(os.environ.get(FAULT_ENV, ""), self.rank)
        self.processes: list[tuple[int, int]] = []  # (host id, pid) per rank, once loaded
        self.load_peak_kb: list[int] = []  # MLX's peak memory while loading, per rank
        # Called once every rank has joined the group (its first collective returned).
        self.on_joined: list[Callable[[], None]] = []
        # What rank 0's front end does when the ranks this process started are lost or
        # stuck (`chat --ranks`: the TUI leaves the screen first); None: end at once.
        self.on_lost: Callable[[str], None] | None = None

    @property
    def front(self) -> bool:
        """Rank 0 owns stdout, the API and the TUI; the other ranks only compute."""
        return self.rank == 0

    def setup(self) -> dict[str, int | str]:
        """How the target is split, as the bench's document records it."""
        return {
            "ranks": self.size,
            "backend": self.config.backend,
            "parallel": self.config.parallel,
        }

    def notify(self, say: Callable[[str], None]) -> Callable[[str], None]:
        return say if self.front else (lambda _: None)

    def open_runtime(
        self, entry, say: Callable[[str], None], calibrate: bool = False, follows: bool = False
    ):
        """Load the target on every rank, check the files agree, shard it, and return a
        Runtime whose engine keeps every rank in step. `calibrate`: agree on the verify
        cost now, on every rank (the chat does it while "loading" shows). `follows`: the
        other ranks will `follow` rank 0 (serve, chat): give them a bell to wait on."""
        from mlxspec.models.loading import load_model
        from mlxspec.registry.runtime import Runtime, target_weights

        notify = self.notify(say)
        threads = f", OpenBLAS {self.blas_threads} thread(s) a rank" if self.blas_threads else ""
        notify(
            f"rank 0 of {self.size} ({self.config.backend}, {self.config.parallel} parallel"
            f"{threads}): loading {entry.name}"
        )
        self.watchdog.disarm()  # loading takes as long as it takes on each host
        mx.reset_peak_memory()
        # Split before any weight is read: each rank reads (and dequantizes) its slices only.
        split = partial(shard, group=self.group, parallel=self.config.parallel)
        weights = target_weights(entry)
        loaded = load_model(
            entry.target, progress=self.front, dequantize=weights.dequantize, shard=split
        )
        mine = fingerprint(loaded.path)
        if self._fault.get("weights") is not None:
            mine ^= 1
        peak_kb = int(mx.get_peak_memory() // 1024)
        rows = self.collectives.all_gather(
            [mine, os.getpid(), _host_id(), peak_kb], "comparing model files"
        )
        for joined in self.on_joined:
            joined()
        prints = rows[:, 0]
        self.processes = [(int(host), int(pid)) for _, pid, host, _ in rows]
        self.load_peak_kb = [int(kb) for kb in rows[:, 3]]
        odd = [r for r in range(self.size) if prints[r] != prints[0]]
        if odd:
            raise DistributedError(
                f"the model files of '{entry.target}' differ between ranks: rank(s) "
                f"{', '.join(map(str, odd))} load other weights than rank 0 (fingerprint "
                f"{prints[odd[0]]:08x} vs {prints[0]:08x}); copy the same files to every host"
            )
        peaks = ", ".join(f"{kb / 1024:.1f}" for kb in self.load_peak_kb)
        notify(f"loaded: each rank holds its shard (peak MiB while loading, per rank: {peaks})")
        width = int(getattr(getattr(loaded.model, "args", None), "hidden_size", 0) or 0)
        if width:
            self.allreduce_seconds = self.collectives.allreduce_latency(width)
        self.allreduces = allreduces_per_forward(loaded.model, self.config.parallel)
        runtime = Runtime(entry, loaded, notify, weights)
        # No history store (suffix decoding drafts from the request only): each host keeps
        # its own history, and a proposer reading it would draft differently on each rank,
        # while every rank must verify the same tokens.
        # Every rank must reuse the same prefixes: a pool bounded by its entries alone (a
        # bound in bytes could let a rank whose shard is larger evict first), no disk.
        engine = RankEngine(
            loaded.model,
            loaded.tokenizer,
            entry.name,
            notify=notify,
            weights=weights,
            prompt_cache=PromptCache(RANK_PROMPT_CACHES),
        )
        engine.collectives = self.collectives
        # Costs are measured by all ranks together (`verify_cost`); a batch's pass grid is
        # not (it would be rank 0's passes alone): its passes are priced from that curve.
        engine.measures_costs = False
        engine.cost_key = calibration_key(
            entry.name,
            engine.weights["held"],
            rank_setup(self.config.parallel, self.size, self.config.backend),
        )
        # Tree shapes are pruned by each rank's own cost estimates, which may differ.
        engine.target.refuse_trees("a sharded target verifies lines only, for now")
        runtime.engine = engine
        # Float KV and no budget of each rank's own: every rank must take the same
        # requests and reuse the same prefixes, whatever its shard holds.
        runtime.kv, runtime.checks_memory = FLOAT, False
        if calibrate:
            engine.verify_cost  # noqa: B018  (a collective: every rank runs it here)
        if follows:
            self._open_bell()
        # Every collective leaves the watchdog armed; what comes next (the user's first
        # turn, a client's first request) may take as long as it takes.
        self.watchdog.disarm()
        return runtime

    def _open_bell(self) -> None:
        """Every rank: connect rank 0's bell to each follower (`distributed.bell`), or
        agree to go on without one."""
        server = bell.listen(self.front_host) if self.front and self.front_host else None
        port = server.getsockname()[1] if server else 0
        (port,) = self.collectives.broadcast_ints([port], "ringing up")
        mine = bell.connect(self.front_host, port) if port and not self.front else None
        reached = self.collectives.all_gather([int(self.front or mine is not None)], "ringing up")
        connections = None
        if self.front and server:
            connections = bell.accept(server, self.size - 1) if reached.all() else None
            if connections is None:
                server.close()
        (rung,) = self.collectives.broadcast_ints([int(connections is not None)], "ringing up")
        if rung:
            self.collectives.bell = bell.Bell(connections if self.front else [mine])
        elif mine is not None:
            mine.close()

    def agree(self, request, settings: GenerationSettings | None, proposer):
        """Rank 0's request on every rank (a random seed is drawn once, on rank 0)."""
        message = self._request_message(request, settings, proposer) if self.front else None
        return _agreed(self.collectives.announce(message, "receiving the request"))

    def _request_message(self, request, settings: GenerationSettings, proposer) -> dict:
        sampling = settings.sampling
        if sampling.seed is None:
            sampling = SamplingSettings(**{**asdict(sampling), "seed": _random_seed()})
        return {
            "request": request,
            "settings": {**asdict(settings), "sampling": asdict(sampling)},
            "proposer": proposer,
        }

    def end_following(self) -> None:
        """Rank 0: tell the ranks in `follow` that no request will come (they return)."""
        self.collectives.announce(None, "stopping the other ranks")

    def follow(self, runtime, max_batch: int = 1) -> None:
        """Ranks other than 0 under serve and chat: run every request rank 0 announces,
        and replay every plan of its batch (`distributed.batch`), in step with it and
        printing nothing, until it announces the end. `max_batch`: the server's."""
        model = runtime.engine.target.model
        batch = None
        if batches(model, max_batch):
            _ = runtime.engine.verify_cost  # rank 0's scheduler calibrates with us at start
            batch = BatchFollower(model, max_batch, self.rank)
        idle = True  # between requests, rank 0 waits for its clients: no deadline
        while (message := self.collectives.await_announcement("receiving work", idle)) is not None:
            if PLAN in message:
                idle = batch.replay(message, self._maybe_fault)
                continue
            idle = True
            request, settings, proposer = _agreed(message)
            runtime.proposer(proposer)  # built on rank 0 before it announced the request
            try:
                for _ in self.run(runtime, request, settings, proposer):
                    pass
            except GenerationError:
                pass  # a request the engine refuses: rank 0 refused it the same way

    def stream(
        self, runtime, request, settings, proposer, stop: Callable[[], bool] | None = None
    ) -> Iterator[Event]:
        """`engine.stream` on every rank, checked after every round; ranks other than 0
        yield only the final Done (they print nothing). `stop`: rank 0 asks whether to
        end the request early (its client left); every rank stops after the same round."""
        if isinstance(request, Conversation):  # the ranks agree on JSON: send its token ids
            request = runtime.engine.encode_chat(request)
        request, settings, proposer = self.agree(request, settings, proposer)
        yield from self.run(runtime, request, settings, proposer, stop)

    def run(
        self, runtime, request, settings, proposer, stop: Callable[[], bool] | None = None
    ) -> Iterator[Event]:
        """An agreed request on this rank (see `stream`)."""
        engine = runtime.engine
        if not self.front:  # it prints nothing: its logprobs would be read for no one
            settings = replace(settings, logprobs=None)
        start_seconds = self.collectives.seconds
        rounds = 0
        self.watchdog.arm("prefilling the prompt")
        events = engine.stream(request, settings, proposer)
        try:
            for event in events:
                self.watchdog.arm("generating")
                if isinstance(event, Step):
                    rounds += 1
                    self._maybe_fault(engine.target, rounds)
                    stopping = self.front and stop is not None and stop()
                    if self.check(engine, event, rounds, stopping):
                        return  # closing the engine's stream leaves its cache consistent
                if isinstance(event, Done):
                    record = event.record
                    self.describe(record)
                    record.collective_seconds = round(self.collectives.seconds - start_seconds, 6)
                    record.collective_rounds = rounds
                if self.front or isinstance(event, Done):
                    yield event
        finally:
            events.close()
            self.watchdog.disarm()

    def describe(self, record) -> None:
        """Stamp a run record with how the target is sharded."""
        record.ranks, record.backend = self.size, self.config.backend
        record.parallel = self.config.parallel
        record.allreduce_seconds = round(self.allreduce_seconds, 7)
        record.allreduces_per_forward = self.allreduces
        record.load_peak_kb = self.load_peak_kb

    def gone_ranks(self) -> list[int]:
        """Ranks on this host whose process has ended (others cannot be seen from here)."""
        here = _host_id()
        return [
            rank
            for rank, (host, pid) in enumerate(self.processes)
            if rank != self.rank and host == here and not _alive(pid)
        ]

    def check(self, engine: Engine, step: Step, round_: int, stopping: bool = False) -> bool:
        """All ranks must hold the same cache after every round; name the one that does
        not. True when rank 0 (`stopping`) ends the request here, on every rank."""
        target = engine.target
        tail = target.cached_tokens[-16:]
        # The first layer that counts its tokens (a recurrent layer's state does not).
        offset = next((c.offset for c in target.cache if hasattr(c, "offset")), 0)
        mine = [
            int(offset),
            len(target.cached_tokens),
            step.drafted,
            step.accepted,
            zlib.crc32(repr(tail).encode()) & 0x7FFFFFFF,
            int(stopping),
        ]
        rows = self.collectives.all_gather(mine, "checking the ranks agree")
        for r in range(1, self.size):
            bad = [i for i in range(len(CHECK_FIELDS)) if rows[r][i] != rows[0][i]]
            if bad:
                what = ", ".join(f"{CHECK_FIELDS[i]} {rows[r][i]} vs {rows[0][i]}" for i in bad)
                raise DistributedError(
                    f"rank {r} diverged from rank 0 in round {round_}: {what}; stopping "
                    "every rank (no output past this point is trusted)"
                )
        return bool(rows[0][-1])

    def _maybe_fault(self, target, round_: int) -> None:
        """Test hook (MLXSPEC_FAULT): break this rank on purpose at a given round (of
        `target`: a Target or a BatchTarget)."""
        if self._fault.get("trim") == round_:
            for c in target.cache:
                c.trim(1)
        if self._fault.get("die") == round_:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fault.get("hang") == round_:
            time.sleep(10_000)


def _agreed(message: dict) -> tuple:
    """(request, settings, proposer) from rank 0's announcement."""
    fields = message["settings"]
    fields["sampling"] = SamplingSettings(**fields["sampling"])
    if fields.get("grammar") is not None:  # plain strings: every rank compiles its own
        fields["grammar"] = Grammar(**fields["grammar"])
    return message["request"], GenerationSettings(**fields), message["proposer"]


def rank_setup(parallel: str, ranks: int, backend: str) -> str:
    """How a sharded target is split: calibrations of different splits are kept apart."""
    return f"{parallel} x{ranks} {backend} pooled"  # pooled: calibrations before it re-run


def _parse_fault(spec: str, rank: int) -> dict[str, int]:
    faults = {}
    for item in filter(None, spec.split(",")):
        kind, who, round_ = (item.split(":") + ["0", "0"])[:3]
        if int(who) == rank:
            faults[kind] = int(round_)
    return faults


def _host_id() -> int:
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def _alive(pid: int) -> bool:
    """Whether a local process still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we know


def _random_seed() -> int:
    import random

    return random.randrange(2**31)


_SESSION: RankSession | None = None


def current_rank() -> RankSession | None:
    """This process's rank session when it runs under `mlxspec ... --ranks/--hostfile`."""
    return _SESSION


def start_session(config: RankConfig) -> RankSession:
    global _SESSION
    _SESSION = RankSession(config)
    return _SESSION


def report_front(session: RankSession) -> None:
    """Rank 0 says where it runs: a stop signal to the owner is sent there, so that a
    server ends its requests and then leads the other ranks out (launch.LaunchStop)."""
    if session.front:
        sys.stderr.write(f"\x1emlxspec-front-pid {os.getpid()} {socket.gethostname()}\n")
        sys.stderr.flush()


def report_exit(code: int) -> None:
    """One marker line per rank for the launching process, which decides the exit code."""
    rank = _SESSION.rank if _SESSION else -1
    sys.stderr.write(f"\x1emlxspec-rank-exit {rank} {code}\n")
    sys.stderr.flush()
