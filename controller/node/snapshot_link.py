"""The snapshot link: how the agents of one job move in-memory snapshot shards between them
(controller/node/snapshots.py decides what moves), and all that a stranger who reaches an
agent's snapshot port can do there: spend a bounded share of it.

Key. Agents prove to each other that they hold the job's snapshot secret, a random value of at
least 16 bytes that whoever starts the agents makes for each run and hands to every agent by
the environment, never on a command line: OPTIMUS_SNAPSHOT_SECRET (the value itself) or
OPTIMUS_SNAPSHOT_SECRET_FILE (a file holding it, that neither group nor others may read or
write). Nothing public is ever a key (the Redis URL, the job's name), nor is a Redis password,
which is another credential. Without a secret an agent starts no server and sends nothing.

Wire format, one TCP connection per transfer, all MACs HMAC-SHA256 under the key, in hex:

    server  32 random bytes, the challenge
    client  MAC(challenge "hello")                                  the proof, before anything
            request, one JSON line (op, point, files|ranks, a nonce of the client's)
            MAC(challenge "request" request)
            push: the files' bytes, exactly as many as their markers say
    server  reply, one JSON line; MAC(challenge "reply" MAC-of-the-request reply)
            pull: the files' bytes

Every line ends with a newline. The reply's MAC covers the request's, so no reply recorded from
another connection passes for this one's; every file is checked against its marker's sha256.

Bounds, on the server (the client keeps the same ones when it reads):
- the proof is read first, 64 characters at most; a wrong, malformed or missing one ends the
  connection with one line of log and nothing said; only then is a request line read, 1 MiB at
  most, and parsed once its own MAC checks;
- time: AUTH_S from the moment a worker takes the connection (TLS handshake included) to an
  authenticated request, then TIMEOUT_S plus the transfer's bytes at MIN_RATE for all of the
  rest; deadlines for the whole request, not per read (and on the server a sweep shuts down
  any connection past its own, whatever it is blocked in);
- connections (snapshot_server.py): WORKERS threads serve them, QUEUED more wait for one
  without a thread, any further one is closed at once;
- a push's markers are checked before a byte of it is read (check_markers: distinct ranks, a
  size of at least 0 bytes each, all of them within the free space of the folder they go to,
  a sha256 each), and exactly the bytes they declare are read.

TLS, optional. OPTIMUS_SNAPSHOT_TLS_CERT (and OPTIMUS_SNAPSHOT_TLS_KEY, unless the certificate
file holds the key) turns it on: the server presents that certificate, which must name the
host the agent advertises; clients verify it against the CA file OPTIMUS_SNAPSHOT_TLS_CA, else
$REDIS_CA_FILE (the one rediss:// URLs use), else the system's CAs. A job's agents all use TLS
or none does: a plain client and a TLS server do not talk.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from optimus.checkpoint.snapshot_files import check_open, install_shards, open_shard, shard_files
from optimus.contract import env

log = logging.getLogger("optimus.agent")

SECRET_ENV, SECRET_FILE_ENV = env.SNAPSHOT_SECRET, env.SNAPSHOT_SECRET_FILE
TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = (env.SNAPSHOT_TLS_CERT, env.SNAPSHOT_TLS_KEY,
                                         env.SNAPSHOT_TLS_CA)
PORT_ENV = env.SNAPSHOT_PORT  # where the server listens; unset: a free port
SECRET_MIN, SECRET_MAX = 16, 4096  # bytes of secret
AUTH_S = 10.0  # from a worker taking a connection to its authenticated request
TIMEOUT_S = 60.0  # the rest of a request, beyond the time its bytes take at MIN_RATE
MIN_RATE = 32 << 20  # bytes/s
LINE_MAX = 1 << 20  # a request or reply line
SHARDS_MAX, RANK_MAX = 4096, 1 << 20  # shards in one transfer; rank numbers
MAC_HEX = 64  # hex characters
_CHUNK, _SEND_CHUNK = 1 << 20, 16 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


# --- the key and TLS -------------------------------------------------------------------------

def read_secret() -> bytes:
    """The job's snapshot key, made from OPTIMUS_SNAPSHOT_SECRET or from the file that
    OPTIMUS_SNAPSHOT_SECRET_FILE names (set one); ValueError says why there is none."""
    value, path = os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV)
    if value and path:
        raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")
    if not value and not path:
        raise ValueError(f"neither {SECRET_ENV} nor {SECRET_FILE_ENV} is set")
    secret = (_secret_file(path) if path else value.encode(errors="surrogateescape")).strip()
    if len(secret) < SECRET_MIN:
        raise ValueError(f"the snapshot secret has {len(secret)} bytes, fewer than "
                         f"{SECRET_MIN}: use a random one, e.g. `openssl rand -hex 32`")
    return hashlib.sha256(b"optimus snapshot link\n" + secret).digest()


def _secret_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
            if mode & 0o077:
                raise ValueError(f"{SECRET_FILE_ENV}: others than its owner may use {path} "
                                 f"(mode {mode:o}): `chmod 600` it")
            secret = f.read(SECRET_MAX + 1)
    except OSError as e:
        raise ValueError(f"{SECRET_FILE_ENV}: cannot read {path}: {e.strerror}") from None
    if len(secret) > SECRET_MAX:
        raise ValueError(f"{SECRET_FILE_ENV}: {path} holds more than {SECRET_MAX} bytes")
    return secret


def job_secret() -> bytes | None:
    """read_secret(), or None where there is none (the keeper then says why). Nothing else is
    a key: not the Redis URL, its password or the job's name."""
    try:
        return read_secret()
    except ValueError:
        return None


def secret_problem() -> str:
    """Why read_secret() gives no key (or that it does, when the caller was given none)."""
    try:
        read_secret()
    except ValueError as e:
        return str(e)
    return "none was given to the snapshot keeper"


@dataclass(frozen=True)
class LinkTLS:
    server: ssl.SSLContext
    client: ssl.SSLContext


def link_tls() -> LinkTLS | None:
    """The TLS contexts the environment asks for (see the top of this module), or None for
    plain TCP. ValueError says what is wrong with them."""
    cert, key, ca = (os.environ.get(n) or None for n in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV))
    if cert is None:
        if key or ca:
            raise ValueError(f"{TLS_KEY_ENV if key else TLS_CA_ENV} is set without "
                             f"{TLS_CERT_ENV}")
        return None
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.minimum_version = ssl.TLSVersion.TLSv1_2
        server.load_cert_chain(cert, key)
        client = ssl.create_default_context(cafile=ca or os.environ.get("REDIS_CA_FILE") or None)
        client.minimum_version = ssl.TLSVersion.TLSv1_2
    except OSError as e:  # ssl.SSLError is one
        raise ValueError(f"snapshot TLS ({TLS_CERT_ENV}={cert}): {e}") from None
    return LinkTLS(server, client)


def listen_port() -> int:
    """The port the snapshot server listens on: OPTIMUS_SNAPSHOT_PORT where a firewall rule
    names it (the Helm chart lets the controller reach only that port of an agent's pod:
    controller/common/probe.py), else 0, any free port. ValueError says what is wrong."""
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(f"{PORT_ENV}={raw[:20]!r} is not a port: give a number from 1 to "
                         "65535, or leave it unset for any free port")
    return int(raw)


def bind_address(host: str) -> str:
    """Where the server listens: the loopback address an agent advertises (a machine of
    simulated nodes, which nothing else needs to reach), else every interface."""
    if host == "localhost":
        return "127.0.0.1"
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        if ip.version == 4 and ip.is_loopback:
            return host
    return "0.0.0.0"


# --- one connection ----------------------------------------------------------------------------

class Link:
    """One connection, every read bounded: in size by its caller, in time by the deadline of
    the whole request."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.challenge, self._buf = sock, b"", bytearray()
        self.deadline = time.monotonic() + seconds

    def allow(self, seconds: float, size: int = 0) -> None:
        """The rest of the request has `seconds`, and the time `size` bytes take at MIN_RATE."""
        self.deadline = time.monotonic() + seconds + size / MIN_RATE

    def set_timeout(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request ran past its deadline")
        self.sock.settimeout(left)

    def _recv(self, most: int) -> bytes:
        self.set_timeout()
        chunk = self.sock.recv(min(most, _CHUNK))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        return chunk

    def line(self, limit: int) -> bytes:
        """The next line, without its newline; ValueError when it is longer than `limit`."""
        start = 0
        while (end := self._buf.find(b"\n", start)) < 0:
            if len(self._buf) > limit:
                raise ValueError(f"a line longer than {limit} bytes")
            start = len(self._buf)
            self._buf += self._recv(limit + 1 - len(self._buf))
        if end > limit:
            raise ValueError(f"a line longer than {limit} bytes")
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        return line

    def exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._buf += self._recv(n - len(self._buf))
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def stream(self, n: int) -> Iterator[bytes]:
        """The next `n` bytes, in chunks, and not one more."""
        if self._buf:
            head = bytes(self._buf[:n])
            del self._buf[:n]
            n -= len(head)
            yield head
        while n > 0:
            chunk = self._recv(n)
            n -= len(chunk)
            yield chunk

    def send(self, data: bytes) -> None:
        self.set_timeout()
        self.sock.sendall(data)

    def send_file(self, f: BinaryIO, size: int) -> None:
        offset = 0
        while offset < size:
            self.set_timeout()
            sent = self.sock.sendfile(f, offset, min(_SEND_CHUNK, size - offset))
            if not sent:
                raise ValueError(f"{f.name} is shorter than its marker says")
            offset += sent


def sign(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).hexdigest().encode()


def check_markers(markers, folder: Path, ranks: list[int] | None = None) -> int:
    """The bytes that the shard markers of a transfer announce, after checking them: a list of
    1 to SHARDS_MAX, each for another rank (exactly `ranks`, when given), each with a size of
    at least 0 bytes and a sha256, all together no more than the free space where they go
    (`folder`, or the nearest folder above it that exists). ValueError says what is wrong."""
    if not isinstance(markers, list) or not 0 < len(markers) <= SHARDS_MAX:
        raise ValueError(f"a transfer names 1 to {SHARDS_MAX} shards")
    seen: set[int] = set()
    for m in markers:
        rank, size = (m.get("rank"), m.get("bytes")) if isinstance(m, dict) else (None, None)
        if type(rank) is not int or not 0 <= rank < RANK_MAX or rank in seen:
            raise ValueError(f"a shard marker names no rank, or one named before: {rank!r}")
        if type(size) is not int or size < 0:
            raise ValueError(f"rank {rank}'s shard declares {size!r} bytes")
        if not isinstance(m.get("sha256"), str) or not _SHA256.fullmatch(m["sha256"]):
            raise ValueError(f"rank {rank}'s shard has no sha256")
        seen.add(rank)
    if ranks is not None and sorted(seen) != sorted(ranks):
        raise ValueError(f"the shards of ranks {sorted(seen)} came, not of {sorted(ranks)}")
    total = sum(m["bytes"] for m in markers)
    there = next(p for p in (folder, *folder.parents) if p.is_dir())
    free = shutil.disk_usage(there).free
    if total > free:
        raise ValueError(f"the shards' {total} bytes do not fit in the {free} bytes free "
                         f"in {there}")
    return total


def receive(link: Link, point_dir: Path, markers: list[dict], lock: threading.Lock) -> None:
    """Files as announced by `markers` (checked: check_markers), each checked against its
    sha256, into a folder of this transfer's own; then, under `lock`, into `point_dir`,
    markers last."""
    incoming = point_dir.parent / f".incoming-{secrets.token_hex(6)}"
    incoming.mkdir(parents=True)
    try:
        for meta in markers:
            data, _ = shard_files(incoming, meta["rank"])
            digest = hashlib.sha256()
            with open(data, "wb") as out:
                for chunk in link.stream(meta["bytes"]):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != meta["sha256"]:
                raise ValueError(f"rank {meta['rank']}'s shard arrived with a wrong sha256")
        with lock:
            install_shards(incoming, point_dir, markers)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


# --- the client: push and pull -----------------------------------------------------------------

def push(addr: str, key: bytes, point_dir: Path, ranks: list[int],
         tls: ssl.SSLContext | None = None) -> None:
    """Send these ranks' shards of a point to the agent at `addr`; raises unless it confirms."""
    with contextlib.ExitStack() as files:
        shards = []
        for rank in ranks:
            meta, f = open_shard(point_dir, rank)
            files.enter_context(f)
            if problem := check_open(meta, f):
                raise ValueError(problem)
            shards.append((meta, f))
        with _connect(addr, tls) as link:
            asked = _request(link, key, {"op": "push", "point": point_dir.name,
                                         "files": [m for m, _ in shards]})
            link.allow(TIMEOUT_S, sum(m["bytes"] for m, _ in shards))
            for meta, f in shards:
                link.send_file(f, meta["bytes"])
            reply = _read_reply(link, key, asked, addr)
    if not reply.get("ok"):
        raise ValueError(f"the buddy refused the snapshot: {reply.get('error')}")


def pull(addr: str, key: bytes, point_dir: Path, ranks: list[int], lock: threading.Lock,
         tls: ssl.SSLContext | None = None) -> None:
    """Fetch these ranks' shards of a point from the agent at `addr` into `point_dir`
    (installed under `lock`, its keeper's)."""
    with _connect(addr, tls) as link:
        asked = _request(link, key, {"op": "pull", "point": point_dir.name, "ranks": ranks})
        reply = _read_reply(link, key, asked, addr)
        if not reply.get("ok"):
            raise ValueError(f"{addr} cannot serve {point_dir.name}: {reply.get('error')}")
        link.allow(TIMEOUT_S, check_markers(reply.get("files"), point_dir.parent, ranks))
        receive(link, point_dir, reply["files"], lock)


@contextlib.contextmanager
def _connect(addr: str, tls: ssl.SSLContext | None) -> Iterator[Link]:
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as raw:
        sock = tls.wrap_socket(raw, server_hostname=host) if tls else raw
        with sock:
            link = Link(sock, TIMEOUT_S)
            try:
                link.challenge = link.exact(32)
            except ConnectionError:
                raise ConnectionError(f"{addr} closed the connection at once: not a snapshot "
                                      "server, a busy one, or one that speaks TLS") from None
            yield link


def _request(link: Link, key: bytes, request: dict) -> bytes:
    """Send the proof and the request; returns the request's MAC (the reply's covers it)."""
    line = json.dumps({**request, "nonce": secrets.token_hex(16)}).encode()
    mac = sign(key, link.challenge, b"request", line)
    link.send(sign(key, link.challenge, b"hello") + b"\n" + line + b"\n" + mac + b"\n")
    return mac


def _read_reply(link: Link, key: bytes, asked: bytes, addr: str) -> dict:
    try:
        line, mac = link.line(LINE_MAX), link.line(MAC_HEX)
    except ConnectionError:
        raise ConnectionError(f"{addr} closed the connection without a reply: it holds another "
                              f"snapshot secret ({SECRET_ENV}), or went down") from None
    if not hmac.compare_digest(mac, sign(key, link.challenge, b"reply", asked, line)):
        raise ValueError("the peer's reply fails authentication: another job's agent, or a "
                         f"different {SECRET_ENV}")
    reply = json.loads(line)
    if not isinstance(reply, dict):
        raise ValueError("the peer's reply is not an object")
    return reply
