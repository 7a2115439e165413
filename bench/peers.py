"""Peer drain benchmark: how fast other Python outbox libraries relay one backlog to Kafka.

Peers (each installed only in its own virtual environment under
``~/.cache/ledgerbox-bench/``, created here on demand and reused; never a project dependency):

* ``faststream-outbox`` — FastStream's outbox on a Postgres table (Python 3.11); no per-key
  order; 4 workers, fetch size 100 and its batched terminal flush (100 rows per DELETE).
* ``omni-box`` — unified outbox & inbox (Python >= 3.12); keeps per-key order; 4 publisher
  loops with batch size 100.

Workload, the same for every peer (and meant for our relay too, see ``bench/peers/_workload.py``):
``EVENTS`` events of 300-byte JSON payloads over 1,000 keys (``k{i % 1000}``), all written to
the peer's outbox table with the peer's own write API before the clock starts; the clock runs
from starting the peer's relay workers until the topic's end offsets add up to ``EVENTS``
(or ``DRAIN_TIMEOUT_S`` passes: then the rate is what was published / the time limit).

Each peer gets its own database (``peer_*``, dropped afterwards) and topic (deleted afterwards)
on the shared services from ``scripts/services.sh``. The peer's code runs in a subprocess with
the peer's interpreter (drivers in ``bench/peers/``).

Run: ``python -m bench.peers [faststream-outbox|omni-box|all] [--events N]``.
See ``docs/bench-peers.md`` for the configurations, the numbers and the caveats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from bench._common import database_url, kafka_bootstrap

DRIVERS = Path(__file__).resolve().parent / "peers"


def _load_workload() -> ModuleType:
    path = DRIVERS / "_workload.py"
    spec = importlib.util.spec_from_file_location("_ledgerbox_peer_workload", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The workload (payload, keys, partitions), shared with the drivers; stdlib only.
workload = _load_workload()

EVENTS = 200_000
DRAIN_TIMEOUT_S = float(os.environ.get("BENCH_PEER_TIMEOUT_S", "600"))
#: A run during which a service restarted or the driver logged broker/database trouble is
#: "disturbed" (the services are shared: other people's tests stop and start them) and is
#: run again, up to this many runs in all.
ATTEMPTS = 3
SERVICES_STATE = Path(
    os.environ.get("OUTBOX_SERVICES_DIR", Path.home() / ".cache" / "outbox-services" / "state")
)
CACHE = Path(os.environ.get("LEDGERBOX_BENCH_CACHE", Path.home() / ".cache" / "ledgerbox-bench"))


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    python: tuple[str, ...]  # interpreters to try, first found wins
    requirements: tuple[str, ...]
    driver: str
    workers: int = 4
    batch: int = 100
    insert_batch: int = 1_000
    flush_batch: int = 1

    @property
    def result_key(self) -> str:
        return f"peer_{self.name.replace('-', '_')}_events_per_s"

    @property
    def venv(self) -> Path:
        return CACHE / f"venv-{self.name}"


#: The versions the documented numbers were measured with.
_COMMON_PINS = ("aiokafka==0.14.0", "sqlalchemy==2.1.9", "asyncpg==0.32.0")

PEERS: dict[str, Peer] = {
    "faststream-outbox": Peer(
        name="faststream-outbox",
        python=("/root/.pyenv/versions/3.11.7/bin/python3.11", "python3.11"),
        requirements=(
            "faststream-outbox[asyncpg]==0.19.0",
            "faststream[kafka]==0.7.8",
            *_COMMON_PINS,
        ),
        driver="faststream_outbox_driver.py",
        # the documented throughput lever ("batched terminal flush"): one DELETE per 100 rows
        # instead of one autocommitted DELETE per row; `--flush-batch 1` is the default
        flush_batch=100,
    ),
    "omni-box": Peer(
        name="omni-box",
        python=("/root/.pyenv/versions/3.12.1/bin/python3.12", "python3.12"),
        requirements=("omni-box[postgres,kafka]==0.3.1", *_COMMON_PINS),
        driver="omni_box_driver.py",
    ),
}


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
SERVICES_WAIT_S = 300.0


async def _kafka_answers(bootstrap: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    try:
        await admin.start()
        await admin.list_topics()
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


def _wait_for_services(timeout_s: float = SERVICES_WAIT_S) -> None:
    """Wait until PostgreSQL and Kafka answer (someone else's outage test may be running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            engine = sa.create_engine(_server(), poolclass=sa.pool.NullPool)
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            engine.dispose()
            if asyncio.run(_kafka_answers(kafka_bootstrap())):
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"PostgreSQL or Kafka did not answer for {timeout_s:.0f} s")
        time.sleep(5)


class DriverFailed(RuntimeError):
    """A peer's driver did not finish; ``tail`` is the end of its output."""

    def __init__(self, message: str, tail: str) -> None:
        super().__init__(message)
        self.tail = tail


def _which(candidates: tuple[str, ...]) -> str:
    for candidate in candidates:
        path = shutil.which(candidate)
        if path:
            return path
    raise RuntimeError(f"no interpreter among {', '.join(candidates)}")


def ensure_venv(peer: Peer) -> Path:
    """Create ``peer.venv`` with its requirements unless it is already there; its python."""
    python = peer.venv / "bin" / "python"
    stamp = peer.venv / ".ledgerbox-requirements"
    wanted = "\n".join(peer.requirements) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    peer.venv.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        subprocess.run([_which(peer.python), "-m", "venv", str(peer.venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    proc = subprocess.run([*pip, *peer.requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        wanted_list = " ".join(peer.requirements)
        raise RuntimeError(f"pip install {wanted_list} failed: {proc.stderr[-2000:]}")
    stamp.write_text(wanted)
    return python


def _server() -> sa.URL:
    return sa.engine.make_url(database_url())


def _create_database(prefix: str) -> tuple[str, str]:
    """Create a fresh database; return (name, its postgresql+asyncpg URL)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(_server(), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = _server().set(drivername="postgresql+asyncpg", database=name)
    return name, url.render_as_string(hide_password=False)


def _drop_database(name: str) -> None:
    admin = sa.create_engine(_server(), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


async def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(name=topic, num_partitions=partitions, replication_factor=1)]
        )
    finally:
        await admin.close()
    # wait until the topic's leaders are known
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        for _ in range(100):
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(topic)
            if parts and len(parts) == partitions:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"topic {topic} did not appear")
    finally:
        await consumer.stop()


async def _delete_topic(bootstrap: str, topic: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


def _service_pids() -> dict[str, str | None]:
    """The Kafka and PostgreSQL process ids of ``scripts/services.sh`` (a change = a restart)."""
    files = {
        "kafka": SERVICES_STATE / "kafka" / "kafka.pid",
        "postgres": SERVICES_STATE / "postgres" / "data" / "postmaster.pid",
    }
    pids: dict[str, str | None] = {}
    for name, path in files.items():
        try:
            pids[name] = path.read_text().split()[0]
        except (OSError, IndexError):
            pids[name] = None
    return pids


def run_peer(peer: Peer, events: int, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, Any]:
    """Install (once), then run one peer's driver on a fresh database and topic; its result."""
    python = ensure_venv(peer)
    bootstrap = kafka_bootstrap()
    tag = peer.name.replace("-", "_")
    topic = f"bench-peer-{peer.name}-{uuid.uuid4().hex[:8]}"
    db_name, db_url = _create_database(f"peer_{tag}")
    try:
        asyncio.run(_create_topic(bootstrap, topic, workload.PARTITIONS))
        with tempfile.TemporaryDirectory(prefix="ledgerbox-peer-") as tmp:
            result_path = Path(tmp) / "result.json"
            log_path = Path(tmp) / "driver.log"
            cmd = [
                str(python),
                str(DRIVERS / peer.driver),
                f"--db-url={db_url}",
                f"--bootstrap={bootstrap}",
                f"--topic={topic}",
                f"--events={events}",
                f"--timeout={timeout_s}",
                f"--result={result_path}",
                f"--workers={peer.workers}",
                f"--batch={peer.batch}",
                f"--insert-batch={peer.insert_batch}",
                f"--flush-batch={peer.flush_batch}",
            ]
            # backlog + drain + shutdown; the backlog of the slowest writer takes a few minutes
            limit = timeout_s + 1_200
            started = time.perf_counter()
            load_before = os.getloadavg()
            pids_before = _service_pids()
            with log_path.open("w") as log:
                try:
                    proc = subprocess.run(
                        cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=tmp
                    )
                    code: int | str = proc.returncode
                except subprocess.TimeoutExpired:
                    code = f"killed after {limit:.0f} s"
            wall_s = time.perf_counter() - started
            tail = log_path.read_text(errors="replace")[-3000:]
            if code != 0 or not result_path.exists():
                lines = [line for line in tail.splitlines() if line.strip()]
                errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
                last = (errors or lines or ["(no output)"])[-1]
                raise DriverFailed(f"driver exited with {code}: {last}", tail)
            result: dict[str, Any] = json.loads(result_path.read_text())
            result["driver_wall_s"] = wall_s
            # the machine is shared: how busy it was (1-minute load averages, 2 cores)
            result["loadavg_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
            restarted = [k for k, v in _service_pids().items() if v != pids_before[k]]
            if restarted:
                result["disturbances"].append(f"restarted during the run: {restarted}")
            result["disturbed"] = bool(result["disturbances"])
            if tail.strip():
                result["driver_log_tail"] = tail[-1500:]
            return result
    finally:
        _drop_database(db_name)
        try:
            asyncio.run(_delete_topic(bootstrap, topic))
        except Exception as exc:  # a leftover topic is harmless; say so
            print(f"   could not delete topic {topic}: {exc}", file=sys.stderr)


def run(
    events: int = EVENTS, peers: list[str] | None = None, **overrides: int
) -> dict[str, object]:
    """Run the peers (all by default); their events/s and notes (``None`` where one failed).

    ``overrides`` (``workers``, ``batch``, ``insert_batch``, ``flush_batch``) replace the
    peers' configured values, for trying variants.
    """
    result: dict[str, object] = {}
    notes: dict[str, object] = {"events": events, "drain_timeout_s": DRAIN_TIMEOUT_S}
    for name in peers or list(PEERS):
        peer = dataclasses.replace(PEERS[name], **overrides)
        earlier: list[dict[str, Any]] = []  # failed or disturbed runs, run again
        figures: dict[str, Any] | None = None
        for attempt in range(1, ATTEMPTS + 1):
            print(f"   peer {name}: {events} events (run {attempt})", flush=True)
            try:
                _wait_for_services()
                figures = run_peer(peer, events)
            except Exception as exc:
                failure = {"error": f"{type(exc).__name__}: {exc}"}
                if isinstance(exc, DriverFailed):
                    failure["output_tail"] = exc.tail
                earlier.append(failure)
                print(f"   peer {name} failed: {exc}", file=sys.stderr, flush=True)
                continue
            if not figures["disturbed"]:
                break
            print(f"   peer {name}: disturbed: {figures['disturbances'][:3]}", flush=True)
            if attempt < ATTEMPTS:
                earlier.append({k: figures[k] for k in ("events_per_s", "drain_s", "disturbances")})
        if figures is None:
            result[peer.result_key] = None
            notes[name] = {**earlier[-1], "earlier_runs": earlier[:-1]}
            continue
        if figures["disturbed"]:
            figures["note_disturbed"] = (
                f"no undisturbed run in {ATTEMPTS}: the last that finished is kept"
            )
        if earlier:
            figures["earlier_runs"] = earlier
        result[peer.result_key] = figures["events_per_s"]
        if not figures["completed"]:
            figures["note"] = (
                f"did not finish within {DRAIN_TIMEOUT_S:.0f} s: events_per_s is what it "
                f"published ({figures['published']}) divided by the time limit"
            )
        notes[name] = figures
        rate = figures["events_per_s"]
        print(f"   peer {name}: {rate:,.0f} events/s ({figures['drain_s']:.1f} s)", flush=True)
    for peer in PEERS.values():
        result.setdefault(peer.result_key, None)
    result["peer_notes"] = notes
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    parser.add_argument("peer", nargs="?", default="all", choices=[*PEERS, "all"])
    parser.add_argument("--events", type=int, default=EVENTS)
    for knob in ("workers", "batch", "insert-batch", "flush-batch"):
        parser.add_argument(f"--{knob}", type=int, help="override the peers' setting (variants)")
    args = parser.parse_args(argv)
    peers = list(PEERS) if args.peer == "all" else [args.peer]
    knobs = ("workers", "batch", "insert_batch", "flush_batch")
    overrides = {k: getattr(args, k) for k in knobs if getattr(args, k) is not None}
    result = run(args.events, peers, **overrides)
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"last-run-{args.peer}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "peer_notes"}, indent=2))
    print(f"written: {path}")
    return 0 if all(result[p.result_key] is not None for p in map(PEERS.get, peers) if p) else 1


if __name__ == "__main__":
    raise SystemExit(main())
