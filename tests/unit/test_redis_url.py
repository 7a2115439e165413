"""A Redis URL that can never work is refused when the consumer's config is built, one line
naming the setting and never the URL (before: a ValueError traceback from the Redis client,
exit 1, which `consumer check` uses for "degraded")."""

from __future__ import annotations

import pytest

from ledgerbox import ConfigurationError
from ledgerbox._core.redis_url import check_redis_url, redis_label
from ledgerbox.inbox import ConsumerConfig


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://:hunter2@127.0.0.1:70000/0", "port that is not a TCP port"),
        ("redis://:hunter2@127.0.0.1:0/0", "port that is not a TCP port"),
        ("redis://:hunter2@127.0.0.1:x/0", "port that is not a TCP port"),
        ("http://:hunter2@127.0.0.1:6379/0", "is not a Redis URL"),
        ("127.0.0.1:6379", "is not a Redis URL"),
        ("redis://:hunter2@127.0.0.1:6379/zero", "database that is not an integer"),
        ("redis://:hunter2@127.0.0.1:6379/0?db=x", "database that is not an integer"),
        ("redis://:hunter2@127.0.0.1:6379/0?socket_timeout=soon", "does not parse"),
        ("unix://", "names no socket path"),
    ],
)
def test_a_redis_url_that_can_never_work_is_refused(url: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=why) as info:
        check_redis_url(url)
    assert info.value.setting == "redis_url"
    assert "hunter2" not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigurationError, match=why):
        ConsumerConfig(
            group_id="g",
            topics=["t"],
            database_url="postgresql+psycopg://u@127.0.0.1:1/db",
            kafka_bootstrap_servers="127.0.0.1:9092",
            redis_url=url,
        )


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://127.0.0.1",
        "redis://user:p%40ss@redis.example:6380/3",
        "rediss://:pw@redis.example:6380/0",
        "unix:///run/redis.sock?db=2",
        "redis://127.0.0.1:6379/0?socket_timeout=0.5",
    ],
)
def test_redis_urls_that_can_work_are_accepted(url: str) -> None:
    check_redis_url(url)


@pytest.mark.parametrize(
    ("url", "label"),
    [
        ("redis://127.0.0.1:6380/0", "127.0.0.1:6380/0"),
        ("redis://:hunter2@cache/3", "cache:6379/3"),
        ("redis://user:hunter2@cache?db=4", "cache:6379/4"),
        ("rediss://user:hunter2@[::1]:7000", "[::1]:7000/0 +TLS"),
        ("unix://:hunter2@/run/redis.sock?db=2", "/run/redis.sock db 2"),
        ("redis://", "localhost:6379/0"),
    ],
)
def test_the_start_line_names_redis_without_its_password(url: str, label: str) -> None:
    check_redis_url(url)
    assert redis_label(url) == label
