"""The one line of an operator command's expected failure (``ledgerbox relay dead ...``,
``ledgerbox consumer dlq ...``, ``ledgerbox consumer purge``): the cause and the fix, the
same for every command (docs/operations.md).

A failed database call says what to do about it
(:func:`ledgerbox._core.database_url.database_remedy`: start the server at host:port, run
``ledgerbox migrate``, the user and the database of a refused login...). A Kafka client that
reached no broker is looked at once more by the startup probe (at most :data:`PROBE_S`): a
listener that refused our TLS or SASL settings is said as such, with its fix, not as
"unreachable". The Kafka client's own log lines are kept off stderr
(:func:`quiet_kafka_client`): the command's line already names the failure.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ledgerbox._core.database_url import database_remedy
from ledgerbox._core.errors import BrokerError, DatabaseError

if TYPE_CHECKING:
    from ledgerbox._core.kafka import KafkaSettings

__all__ = ["PROBE_S", "failure_line", "quiet_kafka_client"]

#: Seconds the probe may take after a Kafka client of an operator command reached no broker.
PROBE_S = 5.0


def failure_line(
    exc: BaseException,
    *,
    database_at: str | None = None,
    url_flag: str = "--database-url",
    kafka: KafkaSettings | None = None,
) -> str:
    """``exc`` as the one line of an operator command, with the fix.

    Parameters
    ----------
    exc : BaseException
        The expected failure (a ``ledgerbox.LedgerboxError``).
    database_at : str | None
        ``host:port/database`` (:func:`~ledgerbox._core.database_url.database_label`) of
        the database the command called; ``None``: a failed call is said as it is.
    url_flag : str
        The setting of the database URL, named in the fix.
    kafka : KafkaSettings | None
        The settings of the command's Kafka clients, probed again when one reached no
        broker.
    """
    if isinstance(exc, DatabaseError):
        return database_remedy(exc, database_at, url_flag=url_flag) if database_at else str(exc)
    if isinstance(exc, BrokerError) and kafka is not None and exc.no_broker:
        from ledgerbox._core.kafka_probe import probe_kafka

        problem = asyncio.run(probe_kafka(kafka, timeout_s=PROBE_S))
        if problem is not None and problem.permanent:
            return problem.cause
    return str(exc)


def quiet_kafka_client() -> None:
    """Keep the Kafka client's own log lines (``aiokafka``: "Unable connect to ...") off
    stderr in an operator command: without a configured handler Python prints them through
    its last-resort handler, before the command's one line, which already names the failure
    (the client's error is translated into ``ledgerbox.BrokerError``). A handler configured
    on the root logger still receives them."""
    log = logging.getLogger("aiokafka")
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())
