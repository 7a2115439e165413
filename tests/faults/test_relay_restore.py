"""C20: the outbox database restored into another cluster, and the cursor's restore guard.

The test cluster has a high transaction counter; a fresh cluster (initdb'ed by the fixture
under /tmp, 127.0.0.1 on a free port of 5490-5499, run as the ``postgres`` OS user like
scripts/services.sh) has a low one. Dump from the test cluster and restore into the fresh
one: the cursors are ahead of the database (behind case) -> the relay refuses the shards,
``relay check`` fails naming them and the repair, ``relay rebase`` re-seats them and every
event is published once, in per-key order. Also when the fresh cluster's counter has caught
up with the cursors before any relay ran (the rows written meanwhile would be skipped
silently by a guard on the counter alone). The reverse (ahead case: the counter is kept or
ahead, as after a physical failover or ``pg_upgrade``) and a restore into another database
of the same cluster are consistent: the guard stays silent and pending events are published,
published ones are not sent again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

from ledgerbox import migrations
from ledgerbox.relay import Relay
from ledgerbox.relay.testing import InMemoryPublisher
from tests import _relay_support as rs
from tests import _services
from tests._services import TopicFactory

KEYS = [f"restore-{i}" for i in range(4)]


def _pg_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        _services.unavailable("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
    return found[-1].parent


def _free_port() -> int:
    for port in range(5490, 5500):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError("no free port in 5490-5499 for the second PostgreSQL cluster")


@dataclass
class Cluster:
    """A second PostgreSQL cluster of the test (trust auth on 127.0.0.1 only)."""

    bin: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str) -> None:
        """Run a server binary as the cluster's owner."""
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *args], check=True, capture_output=True, timeout=120, cwd="/")

    def start(self) -> None:
        self.run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"),
                 "-w", "-t", "60", "start")  # fmt: skip

    def stop(self) -> None:
        self.run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def set_next_xid(self, xid: int) -> None:
        """pg_resetwal -x with the server stopped (the id rounded up to a commit-log page,
        which the server then creates)."""
        page = 32768
        self.stop()
        self.run(str(self.bin / "pg_resetwal"), "-x", str((xid // page + 1) * page), str(self.data))
        self.start()


@pytest.fixture(scope="module")
def fresh_cluster() -> Iterator[Cluster]:
    if not shutil.which("runuser") and os.geteuid() == 0:
        _services.unavailable("runuser is needed to run a second cluster as root")
    root = Path(tempfile.mkdtemp(prefix="ledgerbox-pg2-", dir="/tmp"))
    cluster = Cluster(_pg_bin(), root, _free_port())
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    try:
        cluster.run(str(cluster.bin / "initdb"), "-D", str(cluster.data), "-U", "postgres",
                    "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8")  # fmt: skip
        with open(cluster.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {cluster.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{root}'\nfsync = off\nmax_connections = 40\n"
                "shared_buffers = 32MB\n"
            )
        cluster.start()
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.run(str(cluster.bin / "pg_ctl"), "-D", str(cluster.data), "-m",
                        "immediate", "-w", "stop")  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


def _new_database(server_url: str, *, migrate: bool) -> str:
    server = make_url(server_url)
    name = _services.unique_db_name("ledgerbox_r_")
    url = _services.url_str(_services.create_database(server, name))
    if migrate:
        migrations.upgrade_database(url)
    return url


def _dump_restore(source_url: str, target_server_url: str) -> str:
    """pg_dump the source database, pg_restore it into a new database of the target server."""
    target = _new_database(target_server_url, migrate=False)
    bin_dir = _pg_bin()
    with tempfile.NamedTemporaryFile(suffix=".dump") as dump:
        for args, url in (
            ([str(bin_dir / "pg_dump"), "-Fc", "-f", dump.name], source_url),
            ([str(bin_dir / "pg_restore"), "--no-owner", "--exit-on-error"], target),
        ):
            u = make_url(url)
            conn = [
                "-h", str(u.host), "-p", str(u.port), "-U", str(u.username), "-d", str(u.database)
            ]  # fmt: skip
            cmd = [*args, *conn] if "pg_dump" in args[0] else [*args, *conn, dump.name]
            env = {**os.environ, "PGPASSWORD": u.password or ""}
            subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=env)
    return target


def _drop(url: str) -> None:
    u = make_url(url)
    _services.drop_database(u.set(database="postgres"), str(u.database))


def _stage(url: str, topic: str, seqs: range) -> None:
    engine = create_engine(url)
    try:
        writer = rs.writer_for(topic)
        for seq in seqs:  # one transaction per seq, all keys
            rs.stage(engine, writer, [rs.event(writer, key, seq) for key in KEYS])
    finally:
        engine.dispose()


async def _drain(url: str, kafka: str, publisher: InMemoryPublisher | None = None) -> int:
    relay = Relay(rs.config(url, kafka), publisher=publisher)
    total = 0
    try:
        while n := await relay.run_once():
            total += n
    finally:
        await relay.aclose()
    return total


def _check(url: str, kafka: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", "check", "--database-url", url,
         "--kafka-bootstrap-servers", kafka],
        cwd=rs.REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _rebase(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", "rebase", "--database-url", url, *args],
        cwd=rs.REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _counter(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(text("SELECT pg_snapshot_xmax(pg_current_snapshot())")).scalar_one()
            )
    finally:
        engine.dispose()


def _lease_xmax(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT max(pg_snapshot_xmax(coalesce(hi, lo))) FROM outbox_relay_lease")
                ).scalar_one()
            )
    finally:
        engine.dispose()


async def _records_once_in_order(kafka: str, topic: str, expected: int) -> None:
    records = await rs.consume(
        kafka, topic, until=lambda r: len({rs.header(x, "ce_id") for x in r}) >= expected
    )
    end = time.monotonic() + 1.0
    records = await rs.consume(kafka, topic, until=lambda r: time.monotonic() > end)
    ids = [rs.header(r, "ce_id") for r in records]
    assert len(ids) == len(set(ids)) == expected, "every event once"
    for key in KEYS:
        seqs = [json.loads(r.value or b"")["seq"] for r in records if r.key == key.encode()]
        assert seqs == sorted(seqs) == list(range(len(seqs))), (key, seqs)


def _published_again(publisher: InMemoryPublisher) -> list[int]:
    return sorted(json.loads(r.value)["seq"] for r in publisher.records)


# --------------------------------------------------------------------------- ahead: silent

# First in the module: the caught-up case below moves the fresh cluster's counter up.


@pytest.mark.slow
async def test_c20_restore_into_a_cluster_ahead_is_silent_and_consistent(
    database_server_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    fresh_cluster: Cluster,
) -> None:
    """Dump from the fresh cluster (low counter), restore into the test cluster (high): the
    system identifier changed but the counter is ahead (as after pg_upgrade): the relay
    validates the cursors silently, publishes what was pending and what is new, once."""
    topic = await new_topic.acreate("c20-ahead", partitions=3)
    source = _new_database(fresh_cluster.url(), migrate=True)
    restored: str | None = None
    try:
        _stage(source, topic, range(0, 5))
        assert await _drain(source, kafka_bootstrap) == 20
        _stage(source, topic, range(5, 8))
        restored = _dump_restore(source, database_server_url)
        _stage(restored, topic, range(8, 10))
        assert _check(restored, kafka_bootstrap).returncode == 0
        assert await _drain(restored, kafka_bootstrap) == 20
        await _records_once_in_order(kafka_bootstrap, topic, 40)
        assert _check(restored, kafka_bootstrap).returncode == 0
    finally:
        _drop(source)
        if restored is not None:
            _drop(restored)


# --------------------------------------------------------------------------- behind


@pytest.mark.slow
@pytest.mark.parametrize("counter", ["behind", "caught-up"])
async def test_c20_restore_into_a_cluster_behind_is_refused_then_rebased(
    database_server_url: str,
    kafka_bootstrap: str,
    new_topic: TopicFactory,
    fresh_cluster: Cluster,
    counter: str,
) -> None:
    topic = await new_topic.acreate(f"c20-{counter}", partitions=3)
    source = _new_database(database_server_url, migrate=True)
    restored: str | None = None
    try:
        _stage(source, topic, range(0, 5))  # published before the dump
        assert await _drain(source, kafka_bootstrap) == 20
        _stage(source, topic, range(5, 8))  # pending at the dump
        restored = _dump_restore(source, fresh_cluster.url())
        assert _counter(restored) < _lease_xmax(restored), "the fresh cluster is behind"
        _stage(restored, topic, range(8, 10))  # written after the restore, ids the cursor passed
        if counter == "caught-up":
            # The counter passes the cursors before any relay runs: only the rows written
            # after the last persist with ids the cursors already count betray the restore.
            fresh_cluster.set_next_xid(_lease_xmax(restored))
            assert _counter(restored) > _lease_xmax(restored)
        publisher = InMemoryPublisher()
        assert await _drain(restored, kafka_bootstrap, publisher) == 0, "refused: nothing"
        assert publisher.records == []
        check = _check(restored, kafka_bootstrap)
        assert check.returncode == 2, check.stdout + check.stderr
        line = check.stdout.strip()
        assert len(line.splitlines()) == 1, line
        assert "refused" in line and "ledgerbox relay rebase" in line and "shards" in line, line
        # Relays are stopped, the rebase re-seats every cursor (margin 0: same machine clock).
        dry = _rebase(restored, "--margin-s", "0", "--dry-run")
        assert dry.returncode == 0 and "dry run" in dry.stdout, dry.stdout + dry.stderr
        assert _check(restored, kafka_bootstrap).returncode == 2, "a dry run changes nothing"
        done = _rebase(restored, "--margin-s", "0")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "rows to send again" in done.stdout
        check = _check(restored, kafka_bootstrap)
        assert check.returncode == 0, check.stdout
        assert await _drain(restored, kafka_bootstrap) == 20, "5..9 of 4 keys"
        await _records_once_in_order(kafka_bootstrap, topic, 40)
    finally:
        _drop(source)
        if restored is not None:
            _drop(restored)


async def test_rebase_refuses_while_a_live_relay_holds_leases(
    engine: Engine, database_url: str
) -> None:
    rs.reset_relay_tables(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_relay_lease (shard, fence) SELECT g, 0"
                " FROM generate_series(-1, 63) g ON CONFLICT (shard) DO NOTHING"
            )
        )
        conn.execute(
            text(
                "UPDATE outbox_relay_lease SET owner = 'live-one',"
                " expires_at = now() + interval '1 minute' WHERE shard = 5"
            )
        )
    refused = _rebase(database_url, "--margin-s", "0")
    assert refused.returncode == 2, "a refusal of an operator command exits 2 (1: degraded)"
    assert refused.stderr.strip() == (
        "ledgerbox relay rebase: refused: relays live-one hold leases; stop them (or pass --force)"
    )
    forced = _rebase(database_url, "--margin-s", "0", "--force")
    assert forced.returncode == 0, forced.stderr
    with engine.connect() as conn:
        owner, fence = conn.execute(
            text("SELECT owner, fence FROM outbox_relay_lease WHERE shard = 5")
        ).one()
    assert owner is None and fence == 1, "the live relay's fence is void"


# --------------------------------------------------------------------------- same cluster


async def test_restore_into_another_database_of_the_same_cluster_is_consistent(
    database_server_url: str, kafka_bootstrap: str
) -> None:
    """Same cluster, same counter: nothing to refuse; pending events are published, the
    published ones are not sent again."""
    source = _new_database(database_server_url, migrate=True)
    restored: str | None = None
    try:
        _stage(source, "c20-same", range(0, 3))
        assert await _drain(source, "unused:9092", InMemoryPublisher()) == 12
        _stage(source, "c20-same", range(3, 5))
        restored = _dump_restore(source, database_server_url)
        _stage(restored, "c20-same", range(5, 6))
        publisher = InMemoryPublisher()
        assert await _drain(restored, "unused:9092", publisher) == 12
        assert _published_again(publisher) == sorted([3, 4, 5] * 4)
    finally:
        _drop(source)
        if restored is not None:
            _drop(restored)


async def test_a_new_system_identifier_with_the_counter_kept_is_silent(
    engine: Engine, database_url: str
) -> None:
    """pg_upgrade (and a logical copy into a cluster ahead) gives the database another
    system identifier and keeps the counter: the relay validates the cursors (counter, rows,
    rows written after the persist) and goes on silently."""
    rs.reset_relay_tables(engine)
    topic = f"upgrade-{uuid.uuid4().hex[:6]}"
    _stage(database_url, topic, range(0, 3))
    assert await _drain(database_url, "unused:9092", InMemoryPublisher()) >= 12
    _stage(database_url, topic, range(3, 5))
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_relay_lease SET sysid = sysid + 1 WHERE lo IS NOT NULL"))
    publisher = InMemoryPublisher()
    assert await _drain(database_url, "unused:9092", publisher) == 8
    assert _published_again(publisher) == sorted([3, 4] * 4)
    with engine.connect() as conn:
        refused = conn.execute(
            text("SELECT count(*) FROM outbox_relay_lease WHERE refused IS NOT NULL")
        ).scalar_one()
        moved = conn.execute(
            text(
                "SELECT count(*) FROM outbox_relay_lease WHERE lo IS NOT NULL AND sysid <>"
                " (SELECT system_identifier FROM pg_control_system())"
            )
        ).scalar_one()
    assert refused == 0
    assert moved == 0, "the lease rows name this cluster again"


# --------------------------------------------------------------------------- cleanup


async def test_cleanup_never_deletes_by_a_refused_cursor(engine: Engine, database_url: str) -> None:
    """The state of a restore into a cluster behind (the lease rows carry cursors ahead of
    the counter), left unrepaired past the retention: the leader's cleanup ran while the
    shards were refused and deleted the events written since the restore, which such a
    cursor counts as passed (an adversarial review, 2026-12-05: 6 rows deleted, 0 of 5 new
    events left for `relay rebase` to send)."""
    rs.reset_relay_tables(engine)
    topic = f"cleanup-{uuid.uuid4().hex[:6]}"
    _stage(database_url, topic, range(0, 1))
    assert await _drain(database_url, "unused:9092", InMemoryPublisher()) == 4
    with engine.begin() as conn:
        xmax = int(conn.execute(text("SELECT pg_snapshot_xmax(pg_current_snapshot())")).one()[0])
        ahead = f"{xmax + 1_000_000}:{xmax + 1_000_000}:"
        conn.execute(
            text("UPDATE outbox_relay_lease SET lo = :lo, hi = NULL WHERE shard >= 0"),
            {"lo": ahead},
        )
    _stage(database_url, topic, range(1, 3))  # written after the "restore": never published
    relay = Relay(rs.config(database_url, "unused:9092"), publisher=InMemoryPublisher())
    try:
        for _ in range(3):
            assert await relay.run_once() == 0, "refused: nothing published"
        assert relay.is_leader()
        # And the daemon says so (its health was ok: the same review).
        report = relay.health()
        assert report.state == "down", report
        assert report.cause is not None and report.cause.startswith("shards: 64 shards refused")
        assert "ledgerbox relay rebase" in report.cause
        # Past the retention (default 7 days): the rows and a tick taken after them are old.
        with engine.begin() as conn:
            conn.execute(text("UPDATE outbox SET created_at = created_at - interval '8 days'"))
            conn.execute(
                text(
                    "INSERT INTO outbox_relay_tick (taken_at, horizon) SELECT now() -"
                    " interval '7 days 1 hour', pg_snapshot_xmin(pg_current_snapshot())"
                )
            )
        await relay.cleanup_once()
    finally:
        await relay.aclose()
    with engine.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM outbox WHERE topic = :t AND status = 0"), {"t": topic}
        ).scalar_one()
    assert left == 12, "every row the refused cursors count as passed is still there"
