"""ledgerbox ``relay``: publish committed outbox events to Kafka, in per-key commit order.

Example
-------
>>> config = RelayConfig(database_url="postgresql+psycopg://...",
...                      kafka_bootstrap_servers="127.0.0.1:9092")
>>> relay = Relay(config)
>>> await relay.run()            # doctest: +SKIP  (until relay.stop())

A secured cluster (TLS, SASL; docs/security.md)::

    kafka = KafkaSettings(bootstrap_servers="b-1.example:9096", security_protocol="SASL_SSL",
                          sasl_mechanism="SCRAM-SHA-512", sasl_username="relay",
                          sasl_password=Secret.from_file("/run/secrets/kafka"))
    config = RelayConfig(database_url="postgresql://...?sslmode=verify-full", kafka=kafka)

Run it as a daemon with ``ledgerbox relay run`` (``relay/_cli.py``; every setting in
``docs/configuration.md``). The read design is documented in ``relay._relay`` and
``docs/relay.md``.
"""

if __name__ != "ledgerbox.relay":  # the repository folder is importable from its root too
    raise ImportError(f"import ledgerbox.relay, not {__name__} (one import package: ledgerbox)")


from typing import TYPE_CHECKING

from ledgerbox._core.lazy import lazy_exports

if TYPE_CHECKING:
    from ledgerbox._core.kafka import KafkaSettings
    from ledgerbox._core.redaction import Secret
    from ledgerbox.relay._config import RelayConfig
    from ledgerbox.relay._errors import PublishError, RelayError, StoreError
    from ledgerbox.relay._hooks import RelayHooks
    from ledgerbox.relay._publisher import KafkaPublisher, OutboundRecord, Publisher
    from ledgerbox.relay._relay import Relay
    from ledgerbox.relay._table import RelayTables

__all__ = [
    "KafkaPublisher",
    "KafkaSettings",
    "OutboundRecord",
    "PublishError",
    "Publisher",
    "Relay",
    "RelayConfig",
    "RelayError",
    "RelayHooks",
    "RelayTables",
    "Secret",
    "StoreError",
]

# Lazy (PEP 562): the daemon never imports RelayTables (SQLAlchemy), only what it runs.
if not TYPE_CHECKING:  # type checkers see the imports above, so typos stay errors
    __getattr__, __dir__ = lazy_exports(
        __name__,
        globals(),
        {
            "KafkaPublisher": "ledgerbox.relay._publisher",
            "KafkaSettings": "ledgerbox._core.kafka",
            "OutboundRecord": "ledgerbox.relay._publisher",
            "PublishError": "ledgerbox.relay._errors",
            "Publisher": "ledgerbox.relay._publisher",
            "Relay": "ledgerbox.relay._relay",
            "RelayConfig": "ledgerbox.relay._config",
            "RelayError": "ledgerbox.relay._errors",
            "RelayHooks": "ledgerbox.relay._hooks",
            "RelayTables": "ledgerbox.relay._table",
            "Secret": "ledgerbox._core.redaction",
            "StoreError": "ledgerbox.relay._errors",
        },
    )
