"""Private core shared by ``ledgerbox.outbox``, ``ledgerbox.relay`` and ``ledgerbox.inbox``:
the error root, constants, backoff, identifier validation, lazy exports, the ONE
classification of driver errors, the database URL check and its one-line remedies, and the
plan that runs a sync function and its async twin from one body (``plan``). Nothing here is
public API; import from the subpackages."""
