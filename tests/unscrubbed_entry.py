"""TEST-ONLY entry point: ``python -m tests.unscrubbed_entry ARGS`` runs ``ledgerbox ARGS`` with
the redaction safety net off (:func:`ledgerbox._core.redaction.scrub` is the identity and no log
filter is installed), so that tests/security/test_redaction.py sees what the sources themselves
print: a secret in a message, a log line or a repr fails it even though production would mask
it. Never used in production.
"""

from __future__ import annotations

from ledgerbox._core import redaction


def _identity(text: str) -> str:
    return text


def _no_filter() -> None:
    return None


if __name__ == "__main__":
    # Before the commands are imported: they bind these names when ledgerbox.cli loads them.
    redaction.scrub = _identity
    redaction.install_scrub_filter = _no_filter
    from ledgerbox.cli import main

    main()
