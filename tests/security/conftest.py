"""Fixtures of the security tests (secured endpoints of ``OUTBOX_SECURITY=1 services.sh``).

Without ``OUTBOX_SEC_*`` in the environment these tests skip locally and fail under
``CI=true`` (``make test-security`` starts the endpoints and sets them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text

from tests.security._support import Secured, metadata


@pytest.fixture(scope="session")
def sec() -> Secured:
    return Secured.from_env()


@pytest.fixture
def business(engine: Engine) -> Iterator[Engine]:
    """The consumer app's business table in the module's database, emptied after the test;
    the relay's leases and members forgotten before it."""
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox_relay_lease SET owner = NULL, expires_at = NULL"))
        conn.execute(text("DELETE FROM outbox_relay_member"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM sec_orders"))
