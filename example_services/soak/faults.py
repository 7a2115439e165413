"""What each fault kind of the plan does, and the record of what was done.

:class:`Injector` runs a :class:`~example_services.soak.schedule.PlannedFault`: it waits for
the planned time and for the fault's resource, breaks something, waits, restores it, and
returns a :class:`FaultRecord` with the wall-clock span during which the system was
disturbed (``started`` .. ``ended``: for a broker restart, until the broker is unfenced
again; for a link fault, until the link is cleared). Restoring runs in ``finally``: a
cancelled soak (Ctrl-C, failure) never leaves a broker stopped, a process frozen or a link
black-holed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from aiokafka.errors import KafkaError
from redis.asyncio import Redis

from example_services.demo._kafka import resend_records
from example_services.demo._procs import ManagedProcess
from example_services.soak.proxy import ProxyControl
from example_services.soak.schedule import PlannedFault

__all__ = ["FaultRecord", "Injector", "ServicesScript"]

_SOAK_BACKENDS = (
    "SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s) AND pid <> pg_backend_pid()"
    " AND backend_type = 'client backend' ORDER BY pid"
)


@dataclass
class FaultRecord:
    """One injected fault; times are wall-clock epoch seconds, ``*_s`` from the soak start."""

    index: int
    kind: str
    params: dict[str, Any]
    planned_s: float
    started_s: float | None = None
    ended_s: float | None = None
    started: float | None = None
    ended: float | None = None
    ok: bool = False
    error: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ServicesScript:
    """``scripts/services.sh`` for the soak's services (cluster mode), one command at a time."""

    def __init__(self, script: str, env: Mapping[str, str]) -> None:
        self.script = script
        self.env = dict(env, OUTBOX_KAFKA_NODES="3")
        self.calls: list[tuple[str, float, int]] = []

    async def __call__(self, command: str, *args: str, timeout_s: float = 180.0) -> str:
        """Run one command; returns its stdout.

        Raises
        ------
        RuntimeError
            If the command fails or does not finish within ``timeout_s``.
        """
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            "bash",
            self.script,
            command,
            *args,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"services.sh {command} {' '.join(args)}: timeout") from None
        code = proc.returncode if proc.returncode is not None else -1
        self.calls.append((f"{command} {' '.join(args)}".strip(), time.monotonic() - started, code))
        if code != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"services.sh {command} {' '.join(args)} failed: {tail}")
        return out.decode()


@dataclass
class Injector:
    """Everything a fault needs: processes, services, the proxy, the soak's databases."""

    procs: Mapping[str, ManagedProcess]
    services: ServicesScript
    proxy: ProxyControl
    admin_dsn: str  # libpq DSN of the server's maintenance database (direct, not proxied)
    databases: Sequence[str]  # the soak's database names (their backends are fault targets)
    redis_url: str  # direct
    kafka_direct: str  # bootstrap of the brokers' own listener (not proxied)
    topics: Sequence[str]
    seed: int
    t0_monotonic: float
    t0_wall: float
    log: Callable[[str], None]
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    active: dict[int, str] = field(default_factory=dict)
    records: list[FaultRecord] = field(default_factory=list)

    def active_kinds(self) -> list[str]:
        """Kinds of the faults in progress right now."""
        return sorted(self.active.values())

    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.t0_monotonic, 1)

    async def run_plan(self, plan: Sequence[PlannedFault], deadline_s: float) -> None:
        """Inject every planned fault (overlapping as planned); none starts after the deadline."""
        await asyncio.gather(*(self._run_one(f, deadline_s) for f in plan))

    async def _run_one(self, planned: PlannedFault, deadline_s: float) -> None:
        record = FaultRecord(planned.index, planned.kind, dict(planned.params), planned.at_s)
        self.records.append(record)
        await asyncio.sleep(max(0.0, planned.at_s - (time.monotonic() - self.t0_monotonic)))
        lock = self.locks.setdefault(planned.resource, asyncio.Lock())
        async with lock:
            if self.elapsed_s() > deadline_s:
                record.error = f"not injected: resource {planned.resource} busy until the deadline"
                self.log(f"fault #{planned.index} {planned.kind} skipped ({record.error})")
                return
            rng = random.Random(self.seed * 1000 + planned.index)
            self.active[planned.index] = planned.kind
            record.started, record.started_s = time.time(), self.elapsed_s()
            self.log(f"fault #{planned.index} {planned.kind} {_short(planned.params)}")
            try:
                await self._inject(record, rng)
                record.ok = True
            except asyncio.CancelledError:
                record.error = "cancelled"
                raise
            except Exception as exc:  # reported in the record and the final report
                record.error = repr(exc)
                self.log(f"!! fault #{planned.index} {planned.kind} failed: {exc!r}")
            finally:
                record.ended, record.ended_s = time.time(), self.elapsed_s()
                self.active.pop(planned.index, None)
                took = record.ended_s - (record.started_s or 0.0)
                self.log(f"fault #{planned.index} {planned.kind} over after {took:.1f} s")

    async def _inject(self, record: FaultRecord, rng: random.Random) -> None:
        p = record.params
        kind = record.kind
        handlers: dict[str, Callable[[], Awaitable[None]]] = {
            "relay-kill": lambda: self._kill_process(p["target"], p["down_s"]),
            "consumer-kill": lambda: self._kill_process(p["target"], p["down_s"]),
            "consumer-zombie": lambda: self._zombie(p["target"], p["stopped_s"]),
            "broker-kill": lambda: self._broker_kill(p["broker"], p["down_s"]),
            "broker-stall": lambda: self._broker_stall(p["broker"], p["stalled_s"]),
            "min-isr": lambda: self._min_isr(p["stopped"], p["down_s"], record),
            "cluster-restart": lambda: self._cluster_restart(p["down_s"]),
            "pg-restart": self._pg_restart,
            "pg-backend-kill": lambda: self._pg_backends(signal.SIGKILL, 1, rng, record),
            "pg-terminate": lambda: self._pg_backends(signal.SIGTERM, p["backends"], rng, record),
            "redis-stop": lambda: self._redis_stop(p["down_s"]),
            "redis-flush": lambda: self._redis_flush(record),
            "net-latency": lambda: self._link_hold(record, "latency"),
            "net-bandwidth": lambda: self._link_hold(record, "bandwidth"),
            "net-blackhole": lambda: self._link_hold(record, "blackhole"),
            "net-reset": lambda: self._link_reset(p["group"], p["resets"], record),
            "duplicates": lambda: self._duplicates(p["records"], rng, record),
        }
        await handlers[kind]()

    # ------------------------------------------------------------------ processes

    async def _kill_process(self, name: str, down_s: float) -> None:
        proc = self.procs[name]
        try:
            proc.kill9()
            await asyncio.sleep(down_s)
        finally:
            proc.start()

    async def _zombie(self, name: str, stopped_s: float) -> None:
        proc = self.procs[name]
        try:
            proc.pause()
            await asyncio.sleep(stopped_s)
        finally:
            proc.resume()

    # ------------------------------------------------------------------ Kafka

    async def _broker_kill(self, broker: int, down_s: float) -> None:
        try:
            await self.services("kill-broker", str(broker))
            await asyncio.sleep(down_s)
        finally:
            await self.services("start-broker", str(broker))

    async def _broker_stall(self, broker: int, stalled_s: float) -> None:
        try:
            await self.services("pause-broker", str(broker))
            await asyncio.sleep(stalled_s)
        finally:
            await self.services("resume-broker", str(broker))

    async def _min_isr(self, stopped: list[int], down_s: float, record: FaultRecord) -> None:
        try:
            await asyncio.gather(*(self.services("stop-broker", str(b)) for b in stopped))
            record.notes["brokers_stopped_at_s"] = self.elapsed_s()
            await asyncio.sleep(down_s)
        finally:
            await asyncio.gather(*(self.services("start-broker", str(b)) for b in stopped))

    async def _cluster_restart(self, down_s: float) -> None:
        try:
            await self.services("stop-kafka")
            await asyncio.sleep(down_s)
        finally:
            await self.services("start-kafka")

    # ------------------------------------------------------------------ PostgreSQL

    async def _pg_restart(self) -> None:
        try:
            await self.services("stop-postgres")
        finally:
            await self.services("start-postgres")

    async def _pg_backends(
        self, sig: signal.Signals, count: int, rng: random.Random, record: FaultRecord
    ) -> None:
        """SIGKILL (the postmaster then resets every backend: crash recovery) or SIGTERM
        (``pg_terminate_backend``: only that session ends) ``count`` random soak backends."""
        async with await psycopg.AsyncConnection.connect(
            self.admin_dsn, autocommit=True, connect_timeout=5
        ) as conn:
            rows = await (await conn.execute(_SOAK_BACKENDS, (list(self.databases),))).fetchall()
            pids = [int(r[0]) for r in rows]
            chosen = rng.sample(pids, min(count, len(pids)))
            record.notes |= {"backends": len(pids), "signalled": chosen, "signal": sig.name}
            for pid in chosen:
                if sig is signal.SIGKILL:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                else:
                    await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        if sig is signal.SIGKILL:
            await self._wait_pg_accepts(60.0)

    async def _wait_pg_accepts(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.admin_dsn, autocommit=True, connect_timeout=3
                ) as conn:
                    await conn.execute("SELECT 1")
                    return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)

    # ------------------------------------------------------------------ Redis

    async def _redis_stop(self, down_s: float) -> None:
        try:
            await self.services("stop-redis")
            await asyncio.sleep(down_s)
        finally:
            await self.services("start-redis")

    async def _redis_flush(self, record: FaultRecord) -> None:
        client = Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            record.notes["keys_before"] = int(await client.dbsize())
            await client.flushall()
        finally:
            await client.aclose()

    # ------------------------------------------------------------------ network

    async def _link_hold(self, record: FaultRecord, what: str) -> None:
        p = record.params
        group = p["group"]
        try:
            if what == "latency":
                await self.proxy.latency(group, p["latency_ms"], p["jitter_ms"])
            elif what == "bandwidth":
                await self.proxy.bandwidth(group, p["bandwidth_bps"])
            else:
                await self.proxy.blackhole(group)
            await asyncio.sleep(p["hold_s"])
        finally:
            await self.proxy.clear(group)

    async def _link_reset(self, group: str, resets: int, record: FaultRecord) -> None:
        total = 0
        for i in range(resets):
            if i:
                await asyncio.sleep(1.0)
            total += await self.proxy.reset(group)
        record.notes["connections_reset"] = total

    # ------------------------------------------------------------------ Kafka records

    async def _duplicates(self, count: int, rng: random.Random, record: FaultRecord) -> None:
        """Re-send records; while Kafka refuses (another fault: the cluster restarting, two
        brokers down) try again, for up to 300 s (broker restarts take a minute on a loaded
        machine)."""
        sent: dict[str, int] = {}
        deadline = time.monotonic() + 300.0
        for topic in self.topics:
            while True:
                try:
                    sent[topic] = await asyncio.wait_for(
                        resend_records(self.kafka_direct, topic, count, rng), 60
                    )
                    break
                except (KafkaError, TimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    record.notes["retries"] = record.notes.get("retries", 0) + 1
                    await asyncio.sleep(2.0)
        record.notes["resent"] = sent


def _short(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
