"""ledgerbox: transactional outbox, relay and inbox. The library lives in ``outbox``,
``relay`` and ``inbox``; this package holds only the ``ledgerbox`` command line."""

__version__ = "0.1.0"
__all__ = ["__version__"]
