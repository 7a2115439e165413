"""Settings of the example services and their database bootstrap.

Every setting is an environment variable (pydantic-settings, case-insensitive):

=========================  ==================================================================
``DATABASE_URL``           server to derive the service databases from (SQLAlchemy URL)
``ORDER_DATABASE_URL``     order service database; default ``DATABASE_URL`` with db ``orders``
``PAYMENT_DATABASE_URL``   payment service database; default ``DATABASE_URL`` with db ``payments``
``KAFKA_BOOTSTRAP_SERVERS`` Kafka bootstrap servers, ``host:port[,host:port]``
``REDIS_URL``              Redis for the inbox fast path and aggregate locks (optional)
``ORDERS_TOPIC``           topic of ``OrderPlaced`` (default ``orders.events``)
``PAYMENTS_TOPIC``         topic of ``PaymentSucceeded`` / ``PaymentFailed`` (``payments.events``)
``ORDER_CONSUMER_GROUP``   consumer group of the order service (default ``order-service``)
``PAYMENT_CONSUMER_GROUP`` consumer group of the payment service (default ``payment-service``)
``MIGRATE_ON_START``       the API creates its database and tables at start (default true)
=========================  ==================================================================

Business tables are created with ``metadata.create_all`` at API start (fine for an example;
a real service would ship them as Alembic revisions next to ``migrations.ops``); the ledgerbox
tables (outbox, inbox, relay) come from ``migrations.upgrade_database``.
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

__all__ = [
    "ServiceSettings",
    "drop_database",
    "ensure_database",
    "prepare_database",
    "url_with_database",
]

_DB_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# CREATE DATABASE racing with itself: duplicate_database, or the unique index of pg_database.
_SQLSTATES_ALREADY_EXISTS = frozenset({"42P04", "23505"})


class ServiceSettings(BaseSettings):
    """Environment of the example services (see the module docstring for the variables)."""

    model_config = SettingsConfigDict(extra="ignore")

    database_url: str | None = None
    order_database_url: str | None = None
    payment_database_url: str | None = None
    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    redis_url: str | None = None
    orders_topic: str = "orders.events"
    payments_topic: str = "payments.events"
    order_consumer_group: str = "order-service"
    payment_consumer_group: str = "payment-service"
    migrate_on_start: bool = True

    def order_db_url(self) -> str:
        """SQLAlchemy URL of the order service database."""
        return self.order_database_url or url_with_database(self._base_url(), "orders")

    def payment_db_url(self) -> str:
        """SQLAlchemy URL of the payment service database."""
        return self.payment_database_url or url_with_database(self._base_url(), "payments")

    def _base_url(self) -> str:
        if not self.database_url:
            raise RuntimeError(
                "set DATABASE_URL (or ORDER_DATABASE_URL / PAYMENT_DATABASE_URL), e.g. "
                'eval "$(bash scripts/services.sh up)"'
            )
        return self.database_url


def url_with_database(url: str, database: str) -> str:
    """``url`` with its database name replaced by ``database`` (password kept)."""
    if not _DB_NAME.match(database):
        raise ValueError(f"database name {database!r} must match {_DB_NAME.pattern}")
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def ensure_database(url: str) -> bool:
    """Create the database named in ``url`` if it is missing.

    Connects to the server's ``postgres`` maintenance database. Safe when several processes
    race: "already exists" (SQLSTATE 42P04, or 23505 on ``pg_database``) counts as success.

    Returns
    -------
    bool
        ``True`` if this call created it.
    """
    target = make_url(url)
    name = target.database or ""
    if not _DB_NAME.match(name):
        raise ValueError(f"database name {name!r} must match {_DB_NAME.pattern}")
    server = sa.create_engine(
        target.set(database="postgres"), poolclass=NullPool, isolation_level="AUTOCOMMIT"
    )
    try:
        with server.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
            if exists:
                return False
            try:
                # The name is validated above; CREATE DATABASE takes no bind parameters.
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
            except DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) in _SQLSTATES_ALREADY_EXISTS:
                    return False
                raise
            return True
    finally:
        server.dispose()


def drop_database(url: str) -> None:
    """Drop the database named in ``url`` if it exists (``WITH (FORCE)``: PostgreSQL 13+)."""
    target = make_url(url)
    name = target.database or ""
    if not _DB_NAME.match(name):
        raise ValueError(f"database name {name!r} must match {_DB_NAME.pattern}")
    server = sa.create_engine(
        target.set(database="postgres"), poolclass=NullPool, isolation_level="AUTOCOMMIT"
    )
    try:
        with server.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        server.dispose()


def prepare_database(url: str, metadata: sa.MetaData) -> None:
    """Create the database if missing, migrate the ledgerbox tables, create ``metadata``'s.

    Idempotent. Business tables use ``create_all`` (see the module docstring).
    """
    from ledgerbox.migrations import upgrade_database

    ensure_database(url)
    upgrade_database(url)
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
