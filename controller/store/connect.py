"""From a Redis URL to a client: a single server, or the primary that Redis Sentinel names.

    redis://[user:password@]host:port/db              one server
    rediss://[user:password@]host:port/db             one server over TLS
    redis+sentinel://[user:password@]host1:26379,host2:26379,host3:26379/service[/db]
    rediss+sentinel://...                             the same, TLS to sentinels and servers

The sentinels are asked which server is the primary of `service`; the client asks them again
whenever a connection to the primary fails or finds it demoted, so a failover is followed
without a restart. The user and password in the URL are the data servers' ACL user, never sent
to the sentinels: sentinels with their own password take it from `?sentinel_password=` (and
`sentinel_username=`) or from $REDIS_SENTINEL_PASSWORD. A CA file for TLS comes from
`?ssl_ca_certs=/path` or $REDIS_CA_FILE, and applies to sentinels and servers alike.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_ONLY = ("sentinel_username", "sentinel_password")  # query keys for the sentinels
DEFAULT_SENTINEL_PORT = 26379


class NothingListens(Exception):
    """The server a Redis URL names refused the connection: nothing listens there."""


@dataclass
class SentinelURL:
    """What a redis+sentinel:// URL says: where the sentinels are, which service, and how to
    authenticate to each side."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None  # the data servers' ACL user
    password: str | None = None
    sentinel_auth: dict[str, str] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)  # ssl_ca_certs and the like


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0] in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Split a redis+sentinel:// URL; ValueError says what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a {' or '.join(SENTINEL_SCHEMES)} URL")
    creds, _, hosts = parts.netloc.rpartition("@")
    user, _, password = creds.partition(":")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("the path must be /<service name> or /<service name>/<db>")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database must be a number, not {path[1]!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    sentinel_auth = {k.removeprefix("sentinel_"): query.pop(k) for k in SENTINEL_ONLY
                     if k in query}
    if "password" not in sentinel_auth and os.environ.get("REDIS_SENTINEL_PASSWORD"):
        sentinel_auth["password"] = os.environ["REDIS_SENTINEL_PASSWORD"]
    return SentinelURL(sentinels=[_host_port(h) for h in hosts.split(",") if h],
                       service=path[0], db=int(path[1]) if len(path) == 2 else 0,
                       tls=parts.scheme.startswith("rediss"),
                       username=unquote(user) or None, password=unquote(password) or None,
                       sentinel_auth=sentinel_auth, options=query)


def _host_port(text: str) -> tuple[str, int]:
    """host, host:port or [v6]:port."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if port and not port.isdigit():
        raise ValueError(f"bad sentinel port in {text!r}")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A client for `url` (ValueError for a malformed one). Connections are made lazily: a
    server that is down now is not an error here."""
    common = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
              "decode_responses": True}
    if not is_sentinel(url):
        return redis.Redis.from_url(url, health_check_interval=30, **common, **_ca(url, {}))
    spec = parse_sentinel_url(url)
    tls = {"ssl": True, **_ca(url, spec.options)} if spec.tls else {}
    extra = {k: v for k, v in spec.options.items() if k != "ssl_ca_certs"}
    if extra:
        raise ValueError(f"unknown option(s) {', '.join(sorted(extra))}")
    sentinels = Sentinel(spec.sentinels,
                         sentinel_kwargs={**common, **tls, **spec.sentinel_auth})
    return sentinels.master_for(spec.service, db=spec.db, username=spec.username,
                                password=spec.password, health_check_interval=30,
                                **common, **tls)


def _ca(url: str, options: dict[str, str]) -> dict[str, str]:
    """The CA file for a TLS URL: the URL's own ?ssl_ca_certs= (redis-py reads it from a
    rediss:// URL itself), else $REDIS_CA_FILE."""
    if not url.startswith("rediss") or "ssl_ca_certs=" in url:
        return {"ssl_ca_certs": options["ssl_ca_certs"]} if "ssl_ca_certs" in options else {}
    ca = os.environ.get("REDIS_CA_FILE")
    return {"ssl_ca_certs": ca} if ca else {}


def refused(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from, is a refused connection."""
    while e is not None:
        if isinstance(e, ConnectionRefusedError):
            return True
        e = e.__cause__ or e.__context__
    return False


def safe_url(url: str) -> str:
    """The URL without its passwords (the data servers' and the sentinels'), for messages."""
    url = re.sub(r"(sentinel_password=)[^&]*", r"\1***", url)
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if user else f"{scheme}://***@{host}"


def fail_if_refused(url: str, timeout_s: float = 2.0) -> None:
    """Raise NothingListens at once if the server of a one-server URL refuses a connection.

    For an operator's one-shot command: a refusal is immediate and no retry mends it soon,
    while the store's retries (for a server restarting or failing over) would keep the
    operator waiting for seconds. Any other failure is left to the store, which retries it
    and names it. A sentinel URL is left alone: one sentinel refusing is what they ride out."""
    if is_sentinel(url):
        return
    try:
        client = connect(url, timeout_s)
    except ValueError:
        return  # malformed: the store says how
    try:
        client.ping()
    except redis.RedisError as e:
        if refused(e):
            raise NothingListens(
                f"nothing listens at {safe_url(url)} (connection refused); fix: give --redis (or "
                "$REDIS_URL) the URL the controller uses (`optimus run` prints it), or start "
                "that Redis") from None
    finally:
        client.close()
