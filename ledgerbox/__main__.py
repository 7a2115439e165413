"""``python -m ledgerbox``."""

from ledgerbox.cli import main

main()
