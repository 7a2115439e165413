"""ledgerbox: transactional outbox, relay and inbox for Python microservices.

The library lives in the subpackages :mod:`ledgerbox.outbox` (write events in your business
transaction), :mod:`ledgerbox.relay` (publish committed events to Kafka),
:mod:`ledgerbox.inbox` (apply each event once) and :mod:`ledgerbox.migrations` (the tables).
This module holds only the version and the root of the error tree, so ``import ledgerbox`` is
cheap.
"""

from ledgerbox._core.errors import (
    BrokerError,
    ConfigurationError,
    DatabaseError,
    LedgerboxError,
)

__version__ = "0.2.0"
__all__ = [
    "BrokerError",
    "ConfigurationError",
    "DatabaseError",
    "LedgerboxError",
    "__version__",
]
