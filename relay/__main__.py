"""``python -m relay run|check|status``."""

from relay._cli import main

main()
