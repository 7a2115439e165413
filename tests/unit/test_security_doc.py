"""docs/security.md stays true to the code: its roles grant at least what the relay's and the
consumer's checks require (so a grant the relay starts needing fails here, not in production)
and the app role no more than writing events; every Kafka setting is documented."""

from __future__ import annotations

from pathlib import Path

from ledgerbox._core.kafka import KAFKA_SETTING_NAMES
from ledgerbox.relay._pgstore import REQUIRED_PRIVILEGES
from tests._roles import doc_grants

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
RELAY_TABLES = {
    "outbox": "outbox",
    "lease": "outbox_relay_lease",
    "member": "outbox_relay_member",
    "tick": "outbox_relay_tick",
}


def test_the_relay_role_has_what_relay_check_requires() -> None:
    granted = doc_grants()["relay"]
    for role, privileges in REQUIRED_PRIVILEGES.items():
        table = RELAY_TABLES[role]
        assert set(privileges) <= granted.get(table, set()), (table, privileges)
    assert "INSERT" not in granted["outbox"]  # the relay never writes events


def test_the_consumer_role_has_what_consumer_check_requires_and_purge() -> None:
    granted = doc_grants()["consumer"]
    assert granted["inbox"] == {"SELECT", "INSERT", "UPDATE", "DELETE"}
    assert "outbox" not in granted


def test_the_app_role_only_writes_events() -> None:
    assert doc_grants()["app"] == {"outbox": {"INSERT", "SELECT"}}


def test_every_kafka_setting_is_in_the_security_guide() -> None:
    text = DOC.read_text()
    for name in KAFKA_SETTING_NAMES:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert name.upper() in text, name.upper()
