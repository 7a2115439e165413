"""ledgerbox ``relay``: publish committed outbox events to Kafka, in per-key commit order.

Example
-------
>>> config = RelayConfig(database_url="postgresql+psycopg://...",
...                      kafka_bootstrap_servers="127.0.0.1:9092")
>>> relay = Relay(config)
>>> await relay.run()            # doctest: +SKIP  (until relay.stop())

Run it as a daemon with ``python -m relay run`` (see ``relay/_cli.py``). The read design is
documented in ``relay._relay`` and ``docs/relay.md``.
"""

from typing import TYPE_CHECKING

from outbox._lazy import lazy_exports

if TYPE_CHECKING:
    from relay._config import RelayConfig
    from relay._errors import RelayError, StoreError
    from relay._publisher import KafkaPublisher, OutboundRecord, Publisher
    from relay._relay import Relay
    from relay._table import RelayTables

__all__ = [
    "KafkaPublisher",
    "OutboundRecord",
    "Publisher",
    "Relay",
    "RelayConfig",
    "RelayError",
    "RelayTables",
    "StoreError",
]

# Lazy (PEP 562): the daemon never imports RelayTables (SQLAlchemy), only what it runs.
if not TYPE_CHECKING:  # type checkers see the imports above, so typos stay errors
    __getattr__, __dir__ = lazy_exports(
        __name__,
        globals(),
        {
            "KafkaPublisher": "relay._publisher",
            "OutboundRecord": "relay._publisher",
            "Publisher": "relay._publisher",
            "Relay": "relay._relay",
            "RelayConfig": "relay._config",
            "RelayError": "relay._errors",
            "RelayTables": "relay._table",
            "StoreError": "relay._errors",
        },
    )
