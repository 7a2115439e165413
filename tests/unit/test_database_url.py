"""The database URL check and the one-line remedies of :mod:`ledgerbox._core.database_url`
(pure: no connection is made)."""

from __future__ import annotations

import pytest

from ledgerbox import ConfigurationError, DatabaseError
from ledgerbox._core.database_url import check_database_url, database_label, database_remedy
from ledgerbox._core.faults import Fault


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u:p@127.0.0.1:5432/app",
        "postgresql://u:p@db/app?sslmode=verify-full",
        "postgres://u@h1:5432,h2:5433/app",
        "postgresql://[::1]:5432/app",
    ],
)
def test_urls_that_can_connect_pass(url: str) -> None:
    check_database_url(url)


# What SQLAlchemy's URL.render_as_string writes for a password with a space and a "?"
# (tests/security/test_redaction.py plants such a password): SQLAlchemy parses it and hands the
# parts to psycopg, so the consumers and the operator commands connect with it; libpq, which
# the relay hands its URL to, refuses the raw space.
SPACED = "postgresql+psycopg://u:Cdb%3Fx%3Apa ss@127.0.0.1:5432/app?sslmode=verify-full"


def test_a_url_sqlalchemy_reads_is_judged_by_sqlalchemys_rules() -> None:
    check_database_url(SPACED, reader="sqlalchemy")
    with pytest.raises(ConfigurationError, match="a space not written %20"):
        check_database_url(SPACED)  # the relay's reader: libpq


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("nonsense", "is not a PostgreSQL URL"),
        ("mysql://u:p@h/app", "is not a PostgreSQL URL"),
        ("postgresql+psycopg://u:s3cret@127.0.0.1:99999/app", "not a TCP port"),
        ("postgresql+psycopg://u:s3cret@h:abc/app", "not a TCP port"),
        ("postgresql+psycopg://u:s3cret@h/app?bogus=1", "does not parse as a PostgreSQL URL"),
    ],
)
def test_urls_sqlalchemy_can_never_connect_with_are_refused(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem) as info:
        check_database_url(url, reader="sqlalchemy")
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("nonsense", "is not a PostgreSQL URL"),
        ("mysql://u:p@h/app", "is not a PostgreSQL URL"),
        ("postgresql+psycopg://u:s3cret@127.0.0.1:99999/app", "not a TCP port"),
        ("postgresql+psycopg://u:s3cret@127.0.0.1:0/app", "not a TCP port"),
        ("postgresql://u:s3cret@h:abc/app", "not a TCP port"),
        ("postgresql://u:s3cret@h/app?bogus=1", "does not parse as a PostgreSQL URL"),
    ],
)
def test_urls_that_can_never_connect_are_refused_without_showing_them(
    url: str, problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=problem) as info:
        check_database_url(url)
    assert info.value.setting == "database_url"
    assert "s3cret" not in str(info.value)


def test_label_names_host_port_and_database_never_the_password() -> None:
    assert database_label("postgresql+psycopg://u:pw@db:6543/app") == "db:6543/app"
    assert database_label("postgresql://u:pw@db/app") == "db:5432/app"


@pytest.mark.parametrize(
    ("sqlstate", "fix"),
    [
        (None, "start the server at db:5432, or fix the host/port of --database-url"),
        ("08006", "start the server at db:5432"),
        ("42P01", "run `ledgerbox migrate`"),
        ("3D000", "create the database"),
        ("42501", "GRANT"),
    ],
)
def test_every_remedy_is_one_line_with_the_fix(sqlstate: str | None, fix: str) -> None:
    exc = DatabaseError("read failed: X", fault=Fault.ENVIRONMENT, sqlstate=sqlstate)
    line = database_remedy(exc, "db:5432/app")
    assert fix in line and "read failed: X" in line and "\n" not in line


def test_an_error_already_explained_by_its_seam_is_kept() -> None:
    try:
        try:
            raise DatabaseError("x", fault=Fault.ENVIRONMENT, sqlstate="42P01")
        except DatabaseError as inner:
            raise DatabaseError(
                "the audit table is missing: run `ledgerbox migrate`",
                fault=Fault.ENVIRONMENT,
                sqlstate="42P01",
            ) from inner
    except DatabaseError as outer:
        assert database_remedy(outer, "db:5432/app") == str(outer)


def test_connect_args_bound_every_connection_unless_the_url_or_libpq_environment_does() -> None:
    from ledgerbox._core.database_url import CONNECT_TIMEOUT_S, TCP_ARGS, connect_args

    url = "postgresql+psycopg://app:pw@db:5432/app"
    timeout = {"connect_timeout": CONNECT_TIMEOUT_S}
    assert connect_args(url, environ={}) == {**TCP_ARGS, **timeout}
    assert connect_args(url + "?sslmode=require", environ={}) == {**TCP_ARGS, **timeout}
    # The user's own timeout wins: libpq reads it from the URL or PGCONNECT_TIMEOUT.
    assert connect_args(url + "?connect_timeout=30", environ={}) == TCP_ARGS
    assert connect_args(url + "?sslmode=require&connect_timeout=2", environ={}) == TCP_ARGS
    assert connect_args(url, environ={"PGCONNECT_TIMEOUT": "12"}) == TCP_ARGS
    # So do the URL's own TCP settings, each on its own.
    mine = connect_args(url + "?keepalives_idle=60&tcp_user_timeout=0", environ={})
    assert mine == {
        **{k: v for k, v in TCP_ARGS.items() if k not in ("keepalives_idle", "tcp_user_timeout")},
        **timeout,
    }


def test_connect_args_leave_out_tcp_user_timeout_for_a_libpq_older_than_12(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libpq 11 and older refuse an unknown keyword ("invalid connection option"): every
    connection would fail."""
    from ledgerbox._core import database_url as module

    monkeypatch.setattr(module, "_libpq_version", lambda: 110_005)
    args = module.connect_args("postgresql://db/app", environ={})
    assert "tcp_user_timeout" not in args and args["keepalives_idle"] == 10
    monkeypatch.setattr(module, "_libpq_version", lambda: 170_002)
    assert module.connect_args("postgresql://db/app", environ={})["tcp_user_timeout"] == 30_000


@pytest.mark.parametrize("reader", ["libpq", "sqlalchemy"])
@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://postgres:p@s3cret@127.0.0.1:5433/app", "more than one '@'"),
        ("postgresql+psycopg://u:s3cret@h/app?sslmode=bogus", "sslmode='bogus', which libpq"),
        ("postgresql://u:s3cret@h/app?target_session_attrs=rw", "target_session_attrs='rw'"),
    ],
)
def test_urls_libpq_refuses_before_connecting_are_refused_not_waited_for(
    url: str, problem: str, reader: str
) -> None:
    """A newcomer's review: an unescaped '@' in the password made libpq look for the host
    "s3cret@127.0.0.1", and a misspelt sslmode failed every connection before it was
    tried; both were reported as "the database is unreachable" and the daemons waited
    forever instead of exiting 2."""
    with pytest.raises(ConfigurationError, match=problem) as info:
        check_database_url(url, reader=reader)  # type: ignore[arg-type]
    assert "s3cret" not in str(info.value)


def test_an_escaped_at_sign_in_the_password_passes() -> None:
    check_database_url("postgresql://postgres:p%40ss@127.0.0.1:5433/app")
    check_database_url(
        "postgresql+psycopg://postgres:p%40ss@127.0.0.1:5433/app", reader="sqlalchemy"
    )
