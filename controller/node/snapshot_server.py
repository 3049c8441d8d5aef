"""The snapshot link's server (the protocol, its key and its bounds: snapshot_link.py).

The accepting thread queues each connection for one of WORKERS threads and closes any beyond
QUEUED waiting: no connection has a thread of its own, however many strangers open one. Every
half second it also shuts down the connections past their deadline, whatever their worker is
blocked in (a read, a send, a TLS handshake): a deadline bounds the whole request, not a read.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import secrets
import socket
import socketserver
import ssl
import threading
import time
from pathlib import Path

from controller.node.snapshot_link import (
    AUTH_S,
    LINE_MAX,
    MAC_HEX,
    RANK_MAX,
    SHARDS_MAX,
    TIMEOUT_S,
    Link,
    check_markers,
    receive,
    sign,
)
from optimus.checkpoint.snapshot_files import check_open, open_shard, parse_point, point_name

log = logging.getLogger("optimus.agent")

WORKERS, QUEUED = 8, 32  # connections served at once; waiting for a worker


class LinkServer(socketserver.TCPServer):
    """A keeper's server (`keeper`: its key `secret`, folders `own` and `held`, `lock`, `node`):
    the accepting thread queues each connection for one of WORKERS threads, closes any beyond
    QUEUED waiting, and shuts down those past their deadline."""

    allow_reuse_address = True
    request_queue_size = 64  # the listen backlog: connections are accepted (or closed) at once

    def __init__(self, keeper, bind: str, tls: ssl.SSLContext | None, port: int = 0):
        super().__init__((bind, port), socketserver.BaseRequestHandler)
        self.keeper, self.tls, self.port = keeper, tls, self.server_address[1]
        self._waiting: queue.Queue = queue.Queue(QUEUED)
        self._active: set[Link] = set()
        self._active_lock = threading.Lock()
        self._turned_away, self._said_busy = 0, 0.0
        self._workers = [threading.Thread(target=self._work, name=f"snapshot-serve-{i}",
                                          daemon=True) for i in range(WORKERS)]
        for t in self._workers:
            t.start()
        threading.Thread(target=self.serve_forever, name="snapshot-server", daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        with self._active_lock:
            for link in self._active:
                _hang_up(link)
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._waiting.get_nowait()
                if item is not None:
                    self.shutdown_request(item[0])
        for _ in self._workers:
            self._waiting.put_nowait(None)

    def process_request(self, request, client_address) -> None:  # on the accepting thread
        try:
            self._waiting.put_nowait((request, client_address, time.monotonic()))
        except queue.Full:
            self.shutdown_request(request)
            self._turned_away += 1
            if time.monotonic() - self._said_busy >= 60:
                self._said_busy = time.monotonic()
                log.warning("snapshot server of %s busy: %d connection(s) turned away (the "
                            "latest from %s)", self.keeper.node, self._turned_away,
                            client_address[0])
                self._turned_away = 0

    def service_actions(self) -> None:  # on the accepting thread, every half second
        now = time.monotonic()
        with self._active_lock:
            for link in self._active:
                if link.deadline < now:
                    _hang_up(link)

    def _work(self) -> None:
        while (item := self._waiting.get()) is not None:
            request, client, queued = item
            try:
                if time.monotonic() - queued < TIMEOUT_S:  # else its client gave up
                    self._connection(request, client[0])
            finally:
                self.shutdown_request(request)

    def _connection(self, sock: socket.socket, peer: str) -> None:
        link = Link(sock, AUTH_S)
        with self._active_lock:
            self._active.add(link)
        stage = "TLS handshake"
        try:
            if self.tls:
                link.sock = self.tls.wrap_socket(sock, server_side=True,
                                                 do_handshake_on_connect=False)
                link.set_timeout()
                link.sock.do_handshake()
            stage = "request"
            self._serve(link, peer)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as e:
            # Closed before its handshake: the controller asking whether this agent's host
            # answers (controller/common/probe.py), or a port scan. Nothing to say at info.
            log.log(logging.DEBUG if stage == "TLS handshake" else logging.WARNING,
                    "snapshot connection from %s closed in its %s: %s", peer, stage, e)
        except ConnectionError as e:
            log.info("snapshot connection from %s ended in its %s: %s", peer, stage, e)
        except Exception as e:  # noqa: BLE001 - a peer's doing: one line, never a traceback
            log.warning("snapshot connection from %s dropped in its %s: %s", peer, stage,
                        str(e) or type(e).__name__)
        finally:
            with self._active_lock:
                self._active.discard(link)
            if link.sock is not sock:
                with contextlib.suppress(OSError):
                    link.sock.close()

    def _serve(self, link: Link, peer: str) -> None:
        keeper = self.keeper
        link.challenge = secrets.token_bytes(32)
        link.send(link.challenge)
        authentic = self._authentic(link)
        if authentic is None:
            log.warning("snapshot connection from %s refused: it fails authentication", peer)
            return  # say nothing to a stranger
        line, asked = authentic
        link.allow(TIMEOUT_S)
        try:
            request = json.loads(line)
            point = request["point"]
            if parse_point(point) is None or point_name(*parse_point(point)) != point:
                raise ValueError(f"{point!r} is not a snapshot point")
            if request["op"] == "push":
                link.allow(TIMEOUT_S, check_markers(request["files"], keeper.held))
                receive(link, keeper.held / point, request["files"], keeper.lock)
                self._reply(link, asked, {"ok": True})
            elif request["op"] == "pull":
                self._send_point(link, asked, point, request["ranks"])
            else:
                raise ValueError(f"unknown op {request['op']!r}")
        except (ValueError, KeyError, TypeError) as e:
            self._reply(link, asked, {"ok": False, "error": str(e)})

    def _authentic(self, link: Link) -> tuple[bytes, bytes] | None:
        """The request line and its MAC, read only once the proof checks; None for a peer
        without the key (a proof or MAC wrong, malformed, or too long)."""
        key = self.keeper.secret
        try:
            if not hmac.compare_digest(link.line(MAC_HEX), sign(key, link.challenge, b"hello")):
                return None
            line, asked = link.line(LINE_MAX), link.line(MAC_HEX)
        except ValueError:
            return None
        if not hmac.compare_digest(asked, sign(key, link.challenge, b"request", line)):
            return None
        return line, asked

    def _send_point(self, link: Link, asked: bytes, point: str, ranks) -> None:
        keeper = self.keeper
        if (not isinstance(ranks, list) or not 0 < len(ranks) <= SHARDS_MAX
                or any(type(r) is not int or not 0 <= r < RANK_MAX for r in ranks)):
            raise ValueError(f"a pull names 1 to {SHARDS_MAX} ranks")
        with contextlib.ExitStack() as files:
            with keeper.lock:  # open now: retention may remove the point while it is sent
                found = [(r, [_opened(files, folder / point, r)
                              for folder in (keeper.own, keeper.held)]) for r in ranks]
            shards = []
            for rank, candidates in found:
                good = next((c for c in candidates if c and not check_open(*c)), None)
                if good is None:
                    raise ValueError(f"{keeper.node} holds no good shard of rank {rank} at "
                                     f"{point}")
                shards.append(good)
            self._reply(link, asked, {"ok": True, "files": [m for m, _ in shards]})
            link.allow(TIMEOUT_S, sum(m["bytes"] for m, _ in shards))
            for meta, f in shards:
                link.send_file(f, meta["bytes"])

    def _reply(self, link: Link, asked: bytes, reply: dict) -> None:
        line = json.dumps(reply).encode()
        link.send(line + b"\n" + sign(self.keeper.secret, link.challenge, b"reply", asked, line)
                  + b"\n")


def _hang_up(link: Link) -> None:
    """Wake whatever the connection's worker is blocked in (a read, a send, a handshake)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(link.sock, socket.SHUT_RDWR)


def _opened(files: contextlib.ExitStack, point_dir: Path, rank: int) -> tuple | None:
    """The shard's (marker, open data file), closed with `files`; None where there is none."""
    try:
        meta, f = open_shard(point_dir, rank)
    except ValueError:
        return None
    return meta, files.enter_context(f)
