"""Private core shared by ``ledgerbox.outbox``, ``ledgerbox.relay`` and ``ledgerbox.inbox``:
the error root, constants, backoff, identifier validation, lazy exports and the ONE
classification of driver errors. Nothing here is public API; import from the subpackages."""
