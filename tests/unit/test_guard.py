"""
Tests for L{rhapsode._guard}: who may call a management route.

The matrix checks the guard against an oracle written here from the rules as prose,
so a change to either one that the other does not share shows up as a failing cell.
"""

from __future__ import annotations

import hmac
import itertools
from collections.abc import Sequence

import pytest

from rhapsode._guard import check_management, is_loopback, origin_key
from rhapsode_protocol.errors import Forbidden

TOKEN = "s3cret-management-token"
CONFIGURED = ("https://app.example",)

PEERS = ["127.0.0.1", "::1", "10.0.0.5", "203.0.113.9"]
TOKENS = [None, "wrong-token-value-1234", TOKEN]
ORIGINS = [
    None,
    "http://localhost:3000",
    "http://127.0.0.1",
    "https://app.example",
    "https://evil.example",
    "null",
]
FORWARDED = [None, "127.0.0.1", "198.51.100.7"]
HOSTS = ["localhost:8080", "127.0.0.1:8080", "[::1]:8080", "app.example", "evil.example", None]


def oracle(
    peer: str, presented: str | None, origin: str | None, forwarded: str | None, host: str | None
) -> str | None:
    """
    The refusal the rules call for, or None where the caller is admitted.
    """
    own_or_listed = {"http://localhost:3000", "http://127.0.0.1", "https://app.example"}
    if origin is not None and origin not in own_or_listed:
        return f"origin {origin} is not this machine's and not in management.origins"
    if presented == TOKEN:
        return None
    if peer not in ("127.0.0.1", "::1"):
        return "remote caller without the management token"
    if forwarded == "198.51.100.7":
        return "X-Forwarded-For names a remote caller without the management token"
    if host is None:
        return "a loopback caller without a Host header"
    if host == "evil.example":
        return "host evil.example is not a loopback name, an IP literal or a configured origin"
    return None


def headers_for(
    presented: str | None, origin: str | None, forwarded: str | None, host: str | None
) -> dict[str, list[str]]:
    headers: dict[str, list[str]] = {}
    if presented is not None:
        headers["authorization"] = [f"Bearer {presented}"]
    if origin is not None:
        headers["origin"] = [origin]
    if forwarded is not None:
        headers["x-forwarded-for"] = [forwarded]
    if host is not None:
        headers["host"] = [host]
    return headers


def refusal(
    peer: str | None,
    headers: dict[str, list[str]],
    token: str | None = TOKEN,
    origins: Sequence[str] = CONFIGURED,
) -> str | None:
    """
    The guard's refusal message, or None where it admits the caller.
    """
    try:
        check_management(peer=peer, headers=headers, token=token, origins=origins)
    except Forbidden as e:
        assert e.status == 403
        return e.message
    return None


@pytest.mark.parametrize(
    "peer, presented, origin, forwarded, host",
    list(itertools.product(PEERS, TOKENS, ORIGINS, FORWARDED, HOSTS)),
)
def test_matrix(
    peer: str, presented: str | None, origin: str | None, forwarded: str | None, host: str | None
) -> None:
    """
    Every combination of peer, presented token, Origin, X-Forwarded-For and Host is
    admitted or refused, with the rule named, exactly as the oracle says.
    """
    headers = headers_for(presented, origin, forwarded, host)
    assert refusal(peer, headers) == oracle(peer, presented, origin, forwarded, host)


def test_matrix_covers_every_outcome() -> None:
    """
    The oracle's matrix reaches admission and each of the five refusals, so no rule
    goes untested by it.
    """
    outcomes = {
        oracle(*cell) for cell in itertools.product(PEERS, TOKENS, ORIGINS, FORWARDED, HOSTS)
    }
    assert len(outcomes) == 1 + 2 + 1 + 1 + 1 + 1  # admitted, 2 origins, remote, xff, no host, host


def test_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    The presented token is compared with hmac.compare_digest, never with ==.
    """
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def record(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", record)
    assert refusal("203.0.113.9", {"authorization": [f"Bearer {TOKEN}"]}) is None
    assert calls == [(TOKEN.encode(), TOKEN.encode())]
    assert refusal("203.0.113.9", {"authorization": ["Bearer nope"]}) is not None
    assert calls[-1] == (b"nope", TOKEN.encode())


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(scheme: str) -> None:
    """
    The auth scheme is matched without regard to case, as HTTP says it is.
    """
    assert refusal("203.0.113.9", {"authorization": [f"{scheme} {TOKEN}"]}) is None


@pytest.mark.parametrize(
    "authorization",
    [
        TOKEN,
        f"Basic {TOKEN}",
        f"Bearer{TOKEN}",
        "Bearer",
        "Bearer ",
        f"Bearer {TOKEN} extra",
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN}x",
        "",
    ],
)
def test_malformed_authorization_is_no_token(authorization: str) -> None:
    """
    An Authorization that is not exactly Bearer and the token admits no remote caller,
    and does not make a loopback caller any less admitted.
    """
    headers = {"authorization": [authorization]}
    assert refusal("203.0.113.9", headers) == "remote caller without the management token"
    assert refusal("127.0.0.1", {**headers, "host": ["localhost"]}) is None


def test_no_configured_token_means_no_remote_access() -> None:
    """
    Without management.token nobody is admitted from off the machine, whatever they
    present, and the refusal says no token is configured.
    """
    for presented in ("", "Bearer ", f"Bearer {TOKEN}"):
        message = refusal("203.0.113.9", {"authorization": [presented]}, token=None)
        assert message == "remote caller and no management token is configured"
    assert refusal("127.0.0.1", {"host": ["localhost"]}, token=None) is None
    assert (
        refusal("127.0.0.1", {"host": ["localhost"], "x-forwarded-for": ["10.1.1.1"]}, token=None)
        == "X-Forwarded-For names a remote caller and no management token is configured"
    )


def test_two_authorization_headers_are_refused() -> None:
    """
    A request carrying Authorization twice is refused rather than judged on either one.
    """
    headers = {"authorization": [f"Bearer {TOKEN}", "Bearer other"]}
    assert refusal("203.0.113.9", headers) == "more than one Authorization header"


@pytest.mark.parametrize(
    "address, local",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("127.255.255.254", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("::ffff:127.8.9.10", True),
        ("/run/rhapsode/core.sock", True),
        ("128.0.0.1", False),
        ("10.0.0.5", False),
        ("::ffff:10.0.0.5", False),
        ("::2", False),
        ("fe80::1", False),
        ("localhost", False),
        ("", False),
    ],
)
def test_is_loopback(address: str, local: bool) -> None:
    """
    Loopback is all of 127.0.0.0/8, ::1, IPv4-mapped loopback and a Unix socket path.
    """
    assert is_loopback(address) is local


@pytest.mark.parametrize("peer", ["::ffff:127.0.0.1", "127.8.9.10", None, "/run/rhapsode/core.sock"])
def test_local_peers_are_admitted(peer: str | None) -> None:
    """
    IPv4-mapped loopback, any 127.x address, a Unix socket (a path, or no address at
    all) are local callers that need no token.
    """
    assert refusal(peer, {"host": ["localhost:8080"]}, token=None) is None


@pytest.mark.parametrize(
    "forwarded",
    ["127.0.0.1, 10.0.0.9", "10.0.0.9, 127.0.0.1", "unknown", "127.0.0.1,", "[::1]:80, 8.8.8.8"],
)
def test_any_remote_forwarded_address_makes_the_caller_remote(forwarded: str) -> None:
    """
    X-Forwarded-For from a loopback peer is local only if every element is loopback;
    an element that cannot be read counts as remote.
    """
    headers = {"host": ["localhost"], "x-forwarded-for": [forwarded]}
    assert refusal("127.0.0.1", headers) == (
        "X-Forwarded-For names a remote caller without the management token"
    )


def test_forwarded_loopback_addresses_stay_local() -> None:
    """
    X-Forwarded-For that names only loopback addresses, in any form or over several
    header lines, leaves a loopback caller local.
    """
    headers = {
        "host": ["localhost"],
        "x-forwarded-for": ["127.0.0.1, ::1", "::ffff:127.0.0.2, 127.0.0.1:5123, [::1]:4000"],
    }
    assert refusal("127.0.0.1", headers) is None


def test_forwarded_header_from_a_remote_peer_gains_nothing() -> None:
    """
    A remote peer claiming in X-Forwarded-For to be loopback is still remote.
    """
    headers = {"host": ["localhost"], "x-forwarded-for": ["127.0.0.1"]}
    assert refusal("10.0.0.5", headers) == "remote caller without the management token"


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST:8080",
        "app.localhost",
        "studio.app.localhost:3000",
        "127.0.0.1",
        "192.168.1.20:8080",
        "[::1]",
        "[2001:db8::1]:8080",
        "app.example:8443",
        "localhost:",
    ],
)
def test_hosts_a_loopback_caller_may_name(host: str) -> None:
    """
    A loopback caller may name the server by a loopback name (localhost or any
    *.localhost), an IP literal with or without a port, or a configured origin's host.
    """
    assert refusal("127.0.0.1", {"host": [host]}) is None


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "localhost.evil.example",
        "evillocalhost",
        "::1",
        "[::1",
        "[localhost]:80",
        "[127.0.0.1]:8080",
        "localhost:80a",
        "127.0.0.1.nip.io",
        "",
    ],
)
def test_hosts_a_loopback_caller_may_not_name(host: str) -> None:
    """
    A rebound name, a name that only contains localhost, or a malformed Host is refused
    from loopback without the token, and admitted with it.
    """
    message = refusal("127.0.0.1", {"host": [host]})
    assert message == f"host {host} is not a loopback name, an IP literal or a configured origin"
    assert refusal("127.0.0.1", {"host": [host], "authorization": [f"Bearer {TOKEN}"]}) is None


def test_two_host_headers_are_refused() -> None:
    """
    A request naming two hosts is refused rather than judged on either.
    """
    assert refusal("127.0.0.1", {"host": ["localhost", "evil.example"]}) == "more than one Host header"


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost",
        "https://localhost:5173",
        "http://127.8.9.10:3000",
        "http://[::1]:8080",
        "http://[::ffff:127.0.0.1]",
    ],
)
def test_this_machines_origins_are_admitted_whatever_the_list(origin: str) -> None:
    """
    A page served from this machine is admitted by its origin, any port, with an empty
    management.origins.
    """
    assert refusal("127.0.0.1", {"origin": [origin], "host": ["localhost"]}, origins=()) is None


@pytest.mark.parametrize(
    "origin",
    [
        "null",
        "",
        "file://",
        "ftp://localhost",
        "http://localhost/",
        "http://localhost.evil.example",
        "http://app.localhost",
        "https://app.example.evil.example",
        "http://app.example",
        "https://app.example:8443",
    ],
)
def test_other_origins_are_refused_token_or_not(origin: str) -> None:
    """
    Any other Origin, including null, a look-alike of a listed one, or a listed host
    under another scheme or port, is refused even with the right token.
    """
    headers = {"origin": [origin], "host": ["localhost"], "authorization": [f"Bearer {TOKEN}"]}
    assert refusal("127.0.0.1", headers) == (
        f"origin {origin} is not this machine's and not in management.origins"
    )


def test_token_with_configured_origins() -> None:
    """
    A remote page with the token is admitted from a listed origin, matched by scheme,
    host and effective port, and refused from any other.
    """
    origins = ("https://studio.example:443", "http://lan.example:3000", "http://[2001:db8::5]:8080")
    bearer = {"authorization": [f"Bearer {TOKEN}"]}
    for origin in ("https://studio.example", "http://lan.example:3000", "http://[2001:db8::5]:8080"):
        assert refusal("203.0.113.9", {**bearer, "origin": [origin]}, origins=origins) is None
    assert refusal("203.0.113.9", {**bearer, "origin": ["http://lan.example"]}, origins=origins) == (
        "origin http://lan.example is not this machine's and not in management.origins"
    )
    assert refusal("203.0.113.9", {"origin": ["https://studio.example"]}, origins=origins) == (
        "remote caller without the management token"
    )


def test_two_origin_headers_are_refused() -> None:
    """
    A request carrying Origin twice is refused rather than judged on either one.
    """
    headers = {"origin": ["http://localhost", "https://evil.example"], "host": ["localhost"]}
    assert refusal("127.0.0.1", headers) == "more than one Origin header"


@pytest.mark.parametrize(
    "origin, key",
    [
        ("http://localhost:3000", ("http", "localhost", 3000)),
        ("HTTPS://App.Example", ("https", "app.example", 443)),
        ("http://app.example:80", ("http", "app.example", 80)),
        ("http://[::1]", ("http", "::1", 80)),
        ("http://app.example/", None),
        ("http://app.example#x", None),
        ("http://app.example?", None),
        ("http://u:p@app.example", None),
        ("http://bad host", None),
        ("http://[nope]", None),
        ("http://::1", None),
        ("http://", None),
        ("null", None),
    ],
)
def test_origin_key(origin: str, key: tuple[str, str, int] | None) -> None:
    """
    origin_key reads an absolute http(s) origin into scheme, host and effective port,
    and refuses anything with more than that.
    """
    assert origin_key(origin) == key
