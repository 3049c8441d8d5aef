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

A URL with a password belongs in $REDIS_URL, the environment, never on a command line (where
`ps` shows it to every user of the machine); messages show it through `safe_url`. A reply that
refuses the credentials (WRONGPASS, NOAUTH) or one command of them (NOPERM) is `Denied`: no
retry mends it, so it is never taken for an outage.
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


class Denied(Exception):
    """Redis refused these credentials (WRONGPASS, NOAUTH) or one command of them (NOPERM).
    The message is one line: the server, the user, the command, what to do."""


class _Client(redis.Redis):
    """redis.Redis that notes on a refused command which one it was (`denial` names it)."""

    def execute_command(self, *args, **options):
        try:
            return super().execute_command(*args, **options)
        except (redis.AuthenticationError, redis.ResponseError) as e:
            e.command = _command(args)
            raise


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
        return _Client.from_url(url, health_check_interval=30, **common, **_ca(url, {}))
    spec = parse_sentinel_url(url)
    tls = {"ssl": True, **_ca(url, spec.options)} if spec.tls else {}
    extra = {k: v for k, v in spec.options.items() if k != "ssl_ca_certs"}
    if extra:
        raise ValueError(f"unknown option(s) {', '.join(sorted(extra))}")
    sentinels = Sentinel(spec.sentinels,
                         sentinel_kwargs={**common, **tls, **spec.sentinel_auth})
    return sentinels.master_for(spec.service, redis_class=_Client, db=spec.db,
                                username=spec.username, password=spec.password,
                                health_check_interval=30, **common, **tls)


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


_SECRET_PARAM = re.compile(r"([?&][^=&#]*(?:pass|secret|token|key|auth)[^=&#]*=)[^&#]*",
                           re.IGNORECASE)


def safe_url(url: str) -> str:
    """The URL without its secrets, for messages: the password of user:password@ and every query
    parameter named like one (password, sentinel_password, token, *secret*, *key*, auth...)."""
    url = _SECRET_PARAM.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if "@" not in netloc:
        return url
    creds, host = netloc.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    shown = f"{user}:***@{host}" if user else f"***@{host}"
    return f"{scheme}{sep}{shown}{slash}{tail}"


def has_secret(url: str) -> bool:
    """Whether the URL carries a password (user:password@, or a query parameter like one)."""
    return safe_url(url) != url


def denial(e: BaseException, url: str) -> Denied | None:
    """The `Denied` that a refused command or credentials amount to; None for another error."""
    text = str(e).replace("\n", " ")
    noperm = isinstance(e, redis.exceptions.NoPermissionError) or "NOPERM" in text
    if not noperm and not isinstance(e, redis.AuthenticationError) and not (
            "NOAUTH" in text or "WRONGPASS" in text):
        return None
    command = getattr(e, "command", None)
    piped = re.match(r"Command # \d+ \((.*?)\) of pipeline caused error: (.*)", text)
    if piped:
        command, text = command or _command(piped.group(1).split()), piped.group(2)
    named = re.search(r"run the '(\w+)' command", text)  # MULTI of a pipeline, for one
    if named and not (command or "").upper().startswith(named.group(1).upper()):
        command = named.group(1).upper()
    user = _user(url)
    where = f"Redis at {safe_url(url)}"
    if noperm:
        return Denied(f"{where} refused {command or 'a command'} to user {user} (NOPERM: "
                      f"{text}); fix: use the credentials meant for this process, or grant "
                      "that user this command and key (docs/redis-schema.md, access control)")
    if urlsplit(url).password is None:
        return Denied(f"{where} wants a password and the URL gives none (NOAUTH: {text}); fix: "
                      "put user:password in REDIS_URL, in the environment (never --redis on a "
                      "command line)")
    return Denied(f"{where} refused the credentials of user {user} (WRONGPASS: {text}); fix: "
                  "put that user's password in REDIS_URL, in the environment")


def _user(url: str) -> str:
    name = urlsplit(url).username
    return unquote(name) if name else "default"


def _command(args) -> str:
    """A refused command, named for a message: its name and its first key, never its values
    (AUTH and HELLO carry passwords: their name only)."""
    words = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args]
    if not words:
        return "a command"
    name = words[0].upper()
    if name in ("AUTH", "HELLO", "EVAL", "EVALSHA", "PING", "SELECT", "CLIENT") or len(words) < 2:
        return name
    return f"{name} {words[1]}"


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
                f"nothing listens at {safe_url(url)} (connection refused); fix: give $REDIS_URL "
                "the URL the controller uses (`optimus run` keeps it in "
                "<run_dir>/control/redis.env), or start that Redis") from None
    finally:
        client.close()
