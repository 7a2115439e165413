"""The workload shared by the peer drivers and ``bench.peers`` (stdlib only: it is imported
from the project's virtual environment and from each peer's own).

Every event is a JSON object of about 300 bytes; its key is ``k{i % 1000}``.
"""

from __future__ import annotations

import json

KEYS = 1_000
PAYLOAD_BYTES = 300
PARTITIONS = 6
EVENT_TYPE = "OrderPlaced"


def key_of(i: int) -> str:
    """The ordering key of event ``i``: ``k{i % 1000}``."""
    return f"k{i % KEYS}"


def payload_of(i: int) -> dict[str, object]:
    """Event ``i``'s payload: a JSON object whose compact encoding is ``PAYLOAD_BYTES`` long."""
    body: dict[str, object] = {
        "seq": i,
        "key": key_of(i),
        "type": EVENT_TYPE,
        "order_id": f"order-{i:09d}",
        "customer_id": f"customer-{i % 7919:05d}",
        "amount": f"{(i % 10_000) / 100:.2f}",
        "currency": "EUR",
        "pad": "",
    }
    size = len(json.dumps(body, separators=(",", ":")))
    body["pad"] = "x" * max(0, PAYLOAD_BYTES - size)
    return body
