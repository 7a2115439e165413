"""docker-compose.yml agrees with what the code and the test harness expect.

Static checks only (no Docker): every address an app service is given must resolve to a declared
service and one of its container ports, and Kafka clients must be handed back an address that
the broker actually advertises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy import make_url

from tests import _services

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
URL_VARS = ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")
EXPECTED = {  # service -> (image, port published on the host and used in the container)
    "postgres": (_services.POSTGRES_IMAGE, 5432),
    "kafka": (_services.KAFKA_IMAGE, 9092),
    "redis": (_services.REDIS_IMAGE, 6379),
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def env_of(block: dict[str, Any]) -> dict[str, str]:
    """A service's `environment`, in either compose syntax (mapping or KEY=VALUE list)."""
    env = block.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def port_mappings(service: dict[str, Any]) -> list[tuple[int | None, int]]:
    """(host port or None, container port) for `ports`, short or long syntax."""
    out: list[tuple[int | None, int]] = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            published = entry.get("published")
            out.append((int(published) if published else None, int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        container = int(parts[-1])
        out.append((int(parts[-2]) if len(parts) >= 2 and parts[-2] else None, container))
    return out


def container_ports(service: dict[str, Any]) -> set[int]:
    ports = {container for _, container in port_mappings(service)}
    ports |= {int(str(p).split("/")[0]) for p in service.get("expose") or []}
    return ports


def service_by_host(compose: dict[str, Any], host: str) -> tuple[str, dict[str, Any]]:
    for name, service in compose["services"].items():
        aliases = {name, service.get("hostname"), service.get("container_name")}
        if host in aliases:
            return name, service
    pytest.fail(f"host {host!r} is not a service of {COMPOSE_FILE.name}")


def app_environments(compose: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """Every service environment, plus top-level x-* blocks meant to be merged into one."""
    found = [(f"services.{name}", env_of(svc)) for name, svc in compose["services"].items()]
    for key, value in compose.items():
        if key.startswith("x-") and isinstance(value, dict):
            found.append((key, env_of({"environment": value})))
    return [(where, env) for where, env in found if any(var in env for var in URL_VARS)]


def test_expected_services_images_and_ports(compose: dict[str, Any]) -> None:
    for name, (image, port) in EXPECTED.items():
        service = compose["services"].get(name)
        assert service is not None, f"service {name} missing"
        assert service["image"] == image, "keep compose and tests/_services.py images in sync"
        assert (port, port) in port_mappings(service), f"{name} must publish {port}:{port}"
        assert "healthcheck" in service, f"{name} needs a healthcheck for depends_on"


def test_kafka_is_single_node_kraft(compose: dict[str, Any]) -> None:
    env = env_of(compose["services"]["kafka"])
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "KAFKA_ZOOKEEPER_CONNECT" not in env
    listeners = {
        name: int(addr.rsplit(":", 1)[1])
        for name, addr in (item.split("://") for item in env["KAFKA_LISTENERS"].split(","))
    }
    protocol_map = dict(
        p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert set(listeners) <= set(protocol_map)
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    node_id, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split("@")
    assert node_id == env["KAFKA_NODE_ID"]
    assert int(voter.rsplit(":", 1)[1]) == listeners[controller]
    for var in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[var] == "1", f"{var} must be 1 on a single broker"


def test_kafka_host_listener_is_reachable_from_the_host(compose: dict[str, Any]) -> None:
    # A host client bootstraps on the published port, then connects to whatever address the
    # broker advertises for that listener: it must be the same host port.
    service = compose["services"]["kafka"]
    env = env_of(service)
    listener_ports = {
        name: int(addr.rsplit(":", 1)[1])
        for name, addr in (item.split("://") for item in env["KAFKA_LISTENERS"].split(","))
    }
    published = {container: host for host, container in port_mappings(service) if host}
    host_side = []
    for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","):
        name, addr = item.split("://")
        host, port = addr.rsplit(":", 1)
        if host in {"localhost", "127.0.0.1"}:
            assert published.get(listener_ports[name]) == int(port), item
            host_side.append(int(port))
    assert EXPECTED["kafka"][1] in host_side


def test_app_environments_point_at_declared_services(compose: dict[str, Any]) -> None:
    environments = app_environments(compose)
    assert environments, "expected at least the x-ledgerbox-env block"
    for where, env in environments:
        assert set(URL_VARS) <= set(env), f"{where}: set all of {URL_VARS} together"

        db = make_url(env["DATABASE_URL"])
        assert db.drivername == "postgresql+psycopg", f"{where}: psycopg 3 driver expected"
        name, pg = service_by_host(compose, str(db.host))
        assert (db.port or 5432) in container_ports(pg), f"{where}: DATABASE_URL port"
        pg_env = env_of(pg)
        if "POSTGRES_PASSWORD" in pg_env:
            assert db.username == pg_env.get("POSTGRES_USER", "postgres"), where
            assert db.password == pg_env["POSTGRES_PASSWORD"], where
            assert db.database == pg_env.get("POSTGRES_DB", db.username), where

        for host, port in _services.split_bootstrap(env["KAFKA_BOOTSTRAP_SERVERS"]):
            name, kafka = service_by_host(compose, host)
            assert port in container_ports(kafka), f"{where}: {host}:{port} not a port of {name}"
            advertised = env_of(kafka).get("KAFKA_ADVERTISED_LISTENERS", "")
            assert f"://{host}:{port}" in advertised, (
                f"{where}: {host}:{port} is not advertised by {name}, clients would be "
                "redirected to an address they cannot reach"
            )

        redis = urlsplit(env["REDIS_URL"])
        assert redis.scheme in {"redis", "rediss"}, where
        name, rs = service_by_host(compose, str(redis.hostname))
        assert (redis.port or 6379) in container_ports(rs), f"{where}: REDIS_URL port"
