"""Can we reach Kafka and log in, and if not, why: one connection per bootstrap server,
made by hand (TCP, then TLS, then the SASL login and one metadata request) before any
aiokafka client is built.

Why by hand: an aiokafka client that cannot bootstrap raises ``KafkaConnectionError("Unable
to bootstrap from ...")`` and logs an ERROR line per server, and the real cause (a refused
password, a TLS listener spoken to in plaintext, an untrusted certificate) is lost. Each
cause found here is ONE line naming it and the fix, and says whether waiting can fix it
(``permanent``: the settings are wrong; ``run`` exits with code 2) or not (no broker
answers yet). Used by the relay's and the consumer's startup checks and producer starts
(docs/security.md, "What you see when a setting is wrong").
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from typing import Any

from ledgerbox._core.errors import kafka_unreachable
from ledgerbox._core.kafka import KafkaSettings

__all__ = ["LOGIN_REFUSED", "KafkaProblem", "probe_kafka"]

#: aiokafka error kinds that mean the broker refused our login: waiting will not fix them.
LOGIN_REFUSED = frozenset(
    {
        "SaslAuthenticationFailed",
        "AuthenticationFailedError",
        "AuthenticationMethodNotSupported",
        "UnsupportedSaslMechanismError",
        "IllegalSaslStateError",
    }
)


# Seconds before a "closed after the TLS handshake" is looked at a second time: a broker
# that restarts closes connections too, a listener that refuses us does it every time.
_RECHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class KafkaProblem:
    """Why Kafka cannot be used with these settings.

    Attributes
    ----------
    permanent : bool
        The settings are wrong (refused login, TLS mismatch, untrusted certificate):
        waiting cannot fix it.
    kind : str
        aiokafka's error class name, or ``"Unreachable"``, ``"Timeout"``, ``"TlsExpected"``
        (plaintext spoken to a TLS listener), ``"TlsNotSpoken"`` (TLS spoken to a plaintext
        listener), ``"CertificateUntrusted"``, ``"ClosedAfterTls"``.
    cause : str
        ``"<what>: <fix>"`` in one line; no secret.
    """

    permanent: bool
    kind: str
    cause: str


async def probe_kafka(settings: KafkaSettings, timeout_s: float = 10.0) -> KafkaProblem | None:
    """Connect to each bootstrap server of ``settings`` until one lets us log in and answers
    a metadata request; ``None`` then. Otherwise the problem: a permanent one (of any
    server) before a transient one. Logs nothing, raises nothing for a failing broker.

    Parameters
    ----------
    timeout_s : float
        Bound of each server's attempt, in seconds.
    """
    found: list[KafkaProblem] = []
    for host, port in settings.hosts():  # well-formed: KafkaSettings refused any other
        problem = await _probe_one(settings, host, port, timeout_s)
        if problem is None:
            return None
        if problem.kind == "ClosedAfterTls":
            await asyncio.sleep(_RECHECK_S)
            again = await _probe_one(settings, host, port, timeout_s)
            if again is None:
                return None
            problem = KafkaProblem(again.kind == "ClosedAfterTls", again.kind, again.cause)
        found.append(problem)
    permanent = [p for p in found if p.permanent]
    if permanent:
        return permanent[0]
    if all(p.kind == "Unreachable" for p in found):
        return KafkaProblem(
            False,
            "Unreachable",
            kafka_unreachable(settings.bootstrap_servers),
        )
    return found[0]


async def _probe_one(
    settings: KafkaSettings, host: str, port: int, timeout_s: float
) -> KafkaProblem | None:
    where = f"kafka at {host}:{port}"
    if not await _tcp_accepts(host, port, timeout_s):
        return KafkaProblem(False, "Unreachable", f"{where} does not accept connections")
    from aiokafka.conn import create_conn
    from aiokafka.protocol.metadata import MetadataRequest

    kwargs = settings.client_kwargs()
    kwargs.pop("bootstrap_servers")
    conn: Any = None
    try:
        async with asyncio.timeout(timeout_s):
            conn = await create_conn(
                host, port, client_id="ledgerbox-probe", request_timeout_ms=int(timeout_s * 1000),
                **kwargs,
            )  # fmt: skip
            await conn.send(MetadataRequest([]))
    except TimeoutError:
        return KafkaProblem(False, "Timeout", f"{where} did not answer within {timeout_s:g} s")
    except ssl.SSLCertVerificationError as exc:
        reason = exc.verify_message or exc.reason or "certificate verify failed"
        return KafkaProblem(
            True,
            "CertificateUntrusted",
            f"{where} has a TLS certificate this client does not trust ({reason}): set "
            "kafka_ssl_cafile to the CA that signed the brokers' certificates (and connect by "
            "a name the certificate holds)",
        )
    except Exception as exc:
        return await _diagnose(settings, host, port, timeout_s, exc)
    finally:
        if conn is not None:
            conn.close()
    return None


async def _diagnose(
    settings: KafkaSettings, host: str, port: int, timeout_s: float, exc: BaseException
) -> KafkaProblem:
    where = f"kafka at {host}:{port}"
    kind = type(exc).__name__
    protocol = settings.security_protocol
    if kind in LOGIN_REFUSED:
        return KafkaProblem(True, kind, _login_refused(settings, where, kind))
    speaks_tls = await _speaks_tls(host, port, timeout_s)
    if not settings.tls and speaks_tls:
        return KafkaProblem(
            True,
            "TlsExpected",
            f"{where} speaks TLS but security_protocol is {protocol}: set "
            "kafka_security_protocol to SSL or SASL_SSL (and kafka_ssl_cafile)",
        )
    if settings.tls and speaks_tls is False:
        return KafkaProblem(
            True,
            "TlsNotSpoken",
            f"{where} does not speak TLS but security_protocol is {protocol}: use the "
            "broker's TLS listener, or set kafka_security_protocol to PLAINTEXT or "
            "SASL_PLAINTEXT",
        )
    if settings.tls:
        if settings.ssl_certfile is None and settings.ssl_context is None:
            fix = (
                "it may require a client certificate (set kafka_ssl_certfile and kafka_ssl_keyfile)"
            )
        else:
            fix = "it refused the client certificate (is it signed by a CA the broker trusts?)"
        if not settings.security_protocol.startswith("SASL_"):
            fix += " or a SASL login (kafka_security_protocol SASL_SSL)"
        return KafkaProblem(
            False, "ClosedAfterTls", f"{where} closed the connection after the TLS handshake: {fix}"
        )
    detail = str(exc).strip().splitlines()
    return KafkaProblem(
        False,
        kind,
        f"{where} failed: {kind}{': ' + detail[0] if detail else ''}: check the listener's "
        "security protocol",
    )


def _login_refused(settings: KafkaSettings, where: str, kind: str) -> str:
    mechanism = settings.sasl_mechanism
    if kind == "UnsupportedSaslMechanismError":
        return (
            f"{where} does not offer SASL mechanism {mechanism}: set kafka_sasl_mechanism to "
            "one its listener enables"
        )
    if mechanism == "OAUTHBEARER":
        return (
            f"{where} refused the OAUTHBEARER token ({kind}): check the token provider "
            "(kafka_oauth_token_provider) and the token's audience, scope and expiry"
        )
    return (
        f"{where} refused the login of SASL user {settings.sasl_username!r} ({mechanism}, "
        f"{kind}): fix kafka_sasl_username or kafka_sasl_password"
    )


async def _tcp_accepts(host: str, port: int, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(min(timeout_s, 5.0)):
            _reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _speaks_tls(host: str, port: int, timeout_s: float) -> bool | None:
    """Whether a TLS handshake (no verification: only "is this TLS?") completes; ``None``
    when it cannot be told (no answer in time)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(min(timeout_s, 5.0)):
            _reader, writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=host
            )
    except TimeoutError:
        return None
    except (ssl.SSLError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()
    return True
