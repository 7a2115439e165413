"""Shared helpers for the benchmarks: fresh databases, medians, result files."""

from __future__ import annotations

import json
import os
import statistics
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ledgerbox import migrations

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def database_url() -> str:
    """The server URL from ``DATABASE_URL`` (run ``eval "$(scripts/services.sh up)"`` first)."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit('DATABASE_URL is not set: run `eval "$(bash scripts/services.sh up)"`')
    return url


def kafka_bootstrap() -> str:
    """The broker from ``KAFKA_BOOTSTRAP_SERVERS``."""
    servers = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not servers:
        raise SystemExit("KAFKA_BOOTSTRAP_SERVERS is not set")
    return servers


@contextmanager
def fresh_database(prefix: str = "bench") -> Iterator[str]:
    """Create a database migrated to head; yield its SQLAlchemy URL; drop it afterwards."""
    server = sa.engine.make_url(database_url())
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        migrations.upgrade_database(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def median(values: list[float]) -> float:
    """Median of a non-empty list."""
    return float(statistics.median(values))


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` and return its path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path
