"""
Who may call a management route (protocol.md section 10, "Who may call them").

A pure function of the peer address, the request headers and the management settings,
so the HTTP layer can run it before it reads a body and the rule can be tested as a
table.  It adds one rule to the spec's: a caller admitted for being on loopback must
name this server by a loopback name, an IP literal or a configured origin's host in
its Host header, because a DNS-rebound page reaches loopback under the attacker's own
name and its same-origin GET carries no Origin to refuse.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from rhapsode_protocol.errors import Forbidden

_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOSTNAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", re.ASCII)
_PORT = re.compile(r"(:[0-9]*)?", re.ASCII)


def _loopback_ip(text: str) -> bool:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def is_loopback(address: str) -> bool:
    """
    Whether a peer address is this machine: 127.0.0.0/8, ::1 or ::ffff:127.x.

    A Unix socket path (anything starting with C{/}) is local too, since only a
    process on this machine can connect to one; L{check_management} also reads a peer
    of C{None}, which is what a Unix socket client that never bound a name has, as local.
    """
    return address.startswith("/") or _loopback_ip(address)


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """
    The (scheme, host, port) an absolute http or https origin names, with the scheme's
    default port filled in, or C{None} where C{origin} has anything after the port.
    """
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname or ""
    if (
        parts.scheme not in _DEFAULT_PORTS
        or origin[len(parts.scheme) :] != "://" + parts.netloc
        or "@" in parts.netloc
        or not (_HOSTNAME.fullmatch(host) or _is_ip(host, 6))
    ):
        return None
    return parts.scheme, host, port or _DEFAULT_PORTS[parts.scheme]


def _host_of(value: str) -> str | None:
    """
    The lower-cased host of a C{host[:port]} or C{[v6][:port]}, or C{None} if malformed.
    """
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or not _is_ip(host, 6):
            return None
    else:
        host, colon, port = value.partition(":")
        rest = colon + port
        if not _HOSTNAME.fullmatch(host.lower()):
            return None
    return host.lower() if _PORT.fullmatch(rest) else None


def _is_ip(text: str, version: int | None = None) -> bool:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return version is None or ip.version == version


def _single(headers: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = headers.get(name.lower(), ())
    if len(values) > 1:
        raise Forbidden(f"more than one {name} header")
    return values[0].strip() if values else None


def _forwarded_remote(values: Iterable[str]) -> bool:
    for value in values:
        for element in value.split(","):
            element = element.strip()
            # Some proxies write an address with its port; anything unreadable is remote.
            host = element if _is_ip(element) else _host_of(element)
            if host is None or not _loopback_ip(host):
                return True
    return False


def check_origin(headers: Mapping[str, Sequence[str]], origins: Sequence[str]) -> set[tuple[str, str, int]]:
    """
    Raise L{Forbidden} if the request carries an Origin that is neither this machine's
    nor one of C{origins} (C{management.origins}): the rule of the management routes,
    and the only one C{/mcp} applies (protocol.md section 12).  A request with no
    Origin (an agent, curl) passes.

    @return: the configured origins as (scheme, host, port).
    """
    configured = {key for key in map(origin_key, origins) if key is not None}
    origin = _single(headers, "Origin")
    if origin is not None:
        key = origin_key(origin)
        own = key is not None and (key[1] == "localhost" or _loopback_ip(key[1]))
        if not own and key not in configured:
            raise Forbidden(f"origin {origin} is not this machine's and not in management.origins")
    return configured


def check_management(
    *,
    peer: str | None,
    headers: Mapping[str, Sequence[str]],
    token: str | None,
    origins: Sequence[str],
) -> None:
    """
    Raise L{Forbidden}, naming the rule, unless this caller may use a management route.

    @param peer: the connection's peer address; C{None} or a Unix socket path is local.
    @param headers: lower-cased header names to every value the request carried.
    @param token: C{management.token}; without one only local callers are admitted.
    @param origins: C{management.origins}, as validated by the config.
    """
    configured = check_origin(headers, origins)

    authorization = _single(headers, "Authorization")
    if token and authorization is not None:
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), token.encode()
        ):
            return

    without = "without the management token" if token else "and no management token is configured"
    if peer is not None and not is_loopback(peer):
        raise Forbidden(f"remote caller {without}")
    if _forwarded_remote(headers.get("x-forwarded-for", ())):
        raise Forbidden(f"X-Forwarded-For names a remote caller {without}")

    host = _single(headers, "Host")
    if host is None:
        raise Forbidden("a loopback caller without a Host header")
    name = _host_of(host)
    if name is None or not (
        name == "localhost"
        or name.endswith(".localhost")
        or _is_ip(name)
        or name in {key[1] for key in configured}
    ):
        raise Forbidden(f"host {host} is not a loopback name, an IP literal or a configured origin")
