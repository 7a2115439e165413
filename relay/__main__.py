"""``python -m ledgerbox.relay run|check|status``."""

from ledgerbox.relay._cli import main

main()
