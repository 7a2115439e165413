"""The relay daemon's import graph stays light: no SQLAlchemy, no inbox (its peak RSS target
is 100 MB and ~25 MB of that would be SQLAlchemy alone). Checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
{setup}
heavy = sorted(
    m for m in ("sqlalchemy", "ledgerbox.inbox", "alembic", "redis") if m in sys.modules
)
print(",".join(heavy))
"""


@pytest.mark.parametrize(
    "setup",
    [
        "from ledgerbox import relay; relay.Relay, relay.RelayConfig, relay.KafkaPublisher",
        "import ledgerbox.relay._cli",
        "from ledgerbox import outbox; outbox.EnvelopeParseError, outbox.DEFAULT_SHARD_COUNT",
        # the console script resolving `ledgerbox relay ...`
        "import ledgerbox.cli as c, typer\n"
        "typer.main.get_command(c.app).get_command(None, 'relay')",
    ],
)
def test_relay_paths_do_not_import_sqlalchemy_or_the_inbox(setup: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(setup=setup)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == ""


def test_lazy_exports_still_resolve_every_public_name() -> None:
    from ledgerbox import admin, outbox, relay

    for module in (outbox, relay, admin):
        for name in module.__all__:
            assert getattr(module, name) is not None, name
        assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError):
        _ = outbox.NoSuchName  # type: ignore[attr-defined]
