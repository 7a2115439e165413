"""``python -m ledgerbox.inbox run --app module:attribute``."""

from ledgerbox.inbox._cli import app

app()
