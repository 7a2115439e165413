"""The operator docs say what the commands do: the DLQ replay command exists, and ``--limit``
caps a selection but is not one of its filters (``--all-matching --limit 5`` alone is refused
as unfiltered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_inbox_doc_names_the_dlq_replay_command_instead_of_promising_it() -> None:
    text = (DOCS / "inbox.md").read_text()
    assert "comes later" not in text
    assert "ledgerbox consumer dlq replay" in text


@pytest.mark.parametrize("doc", ["operations.md", "configuration.md", "inbox.md"])
def test_no_doc_lists_limit_among_the_filters(doc: str) -> None:
    text = " ".join((DOCS / doc).read_text().split())
    # "filters `--key`, `--error` (any case), `--limit`": limit as an item of the list.
    item = r"`[^`]+`(?:\s*\([^)]*\))?"
    enumeration = rf"(?:[Ff]ilters|selection settings|selection flags):?\s*\(?(?:{item},\s*)+"
    listed = re.findall(rf"{enumeration}(?:and\s+)?`-*limit`", text)
    assert listed == [], listed


def test_the_cli_does_not_offer_limit_as_a_filter() -> None:
    from typer.testing import CliRunner

    from ledgerbox.cli import app

    url = "postgresql+psycopg://u@127.0.0.1:1/x"
    for args in (["relay", "dead", "replay"], ["consumer", "dlq", "replay"]):
        result = CliRunner().invoke(app, [*args, "--database-url", url])
        assert result.exit_code == 2
        [line] = result.stderr.splitlines()
        assert "--limit caps how many" in line and ", --limit)" not in line, line
