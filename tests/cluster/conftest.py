"""Opt-in tests of the 3-broker cluster (``OUTBOX_KAFKA_NODES=3``, ``make test-cluster``).

The tests here run only when ``OUTBOX_KAFKA_NODES=3`` is set (``make test-cluster`` and
``make soak`` set it and start the cluster); otherwise they are deselected, never skipped and
never counted as passed. Once selected they FAIL when the cluster is not there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def cluster_selected() -> bool:
    return os.environ.get("OUTBOX_KAFKA_NODES", "1").strip() == "3"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cluster_selected():
        return
    mine = [item for item in items if HERE in item.path.parents]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [item for item in items if HERE not in item.path.parents]
