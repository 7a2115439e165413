"""``python -m inbox run --app module:attribute``."""

from inbox._cli import app

app()
