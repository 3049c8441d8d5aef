"""Every operator command that changes something takes --yes and --reason; chaos asks first."""

from __future__ import annotations

import json
import os
import pty
import threading
import time
from pathlib import Path

import pytest
from cluster import RedisServer, relay
from records import run_plan
from test_operator import _who, optimus

from controller.store.store import Store

MUTATING = {  # the command, and the job record it needs to be accepted
    "job pause": (["job", "pause"], {}),
    "job resume": (["job", "resume"], {"desired": "pause", "state": "PAUSED"}),
    "job stop": (["job", "stop"], {}),
    "job checkpoint": (["job", "checkpoint"], {}),
    "node exclude": (["node", "exclude", "node1"], {}),
    "node drain": (["node", "drain", "node1"], {}),
    "node include": (["node", "include", "node1"], {}),
    "chaos kill-rank": (["chaos", "kill-rank", "--rank", "1"], {}),
    "chaos freeze-rank": (["chaos", "freeze-rank", "--rank", "1"], {}),
    "chaos hang-rank": (["chaos", "hang-rank", "--rank", "1"], {}),
    "chaos stall-rank": (["chaos", "stall-rank", "--rank", "1", "--seconds", "2"], {}),
    "chaos kill-node": (["chaos", "kill-node", "--node", "node1"], {}),
    "chaos bad-tile": (["chaos", "bad-tile", "--node", "node1"], {}),
}


class FakeController:
    """A running two-node job in a real redis-server, whose 'controller' (a thread) answers
    every operator request with the event the CLI waits for."""

    def __init__(self, tmp: Path, **record: str):
        self.server = RedisServer(tmp)
        self.store = Store(self.server.url, "yes")
        self.store.update_job({"state": "RUNNING", "generation": 0, **record})
        self.store.set_plan(run_plan(0, ["node0", "node1"]))
        for name in ("node0", "node1"):
            self.store.own.register_node(name, {"host": name, "health": "ok"})
        relay(self.store)  # the records a controller would have relayed
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        after = "0"
        while not self.done.is_set():
            _, requests, _ = self.store.operator_view(after)
            for rid, r in requests:
                after = rid
                self.store.event("controller", r["action"], f"{r['action']} taken",
                                 request=rid, reason=r["reason"])
            time.sleep(0.05)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.server.stop()


@pytest.mark.parametrize("name", list(MUTATING))
def test_every_mutating_command_takes_yes_and_reason(name, tmp_path):
    args, record = MUTATING[name]
    fake = FakeController(tmp_path, **record)
    if name == "node include":
        fake.store.exclude("node1", "ECC errors", by="ana@desk", mode="exclude")
    try:
        out = optimus(*args, "--job", "yes", "--yes", "--reason", "scripted", url=fake.server.url,
                      timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        if args[0] == "chaos":  # a command for the node's agent, with who and why
            (raw,) = fake.store.r.lrange(fake.store.k("commands:node1"), 0, -1)
            command = json.loads(raw)
            assert command["kind"] == args[1].replace("-", "_")
            assert (command["reason"], command["by"]) == ("scripted", _who())
        else:  # a request, answered
            ((_, request),) = fake.store.r.xrange(fake.store.k("requests"))
            assert (request["action"], request["reason"]) == (args[1], "scripted")
            assert f"{args[1]} taken" in out.stdout
    finally:
        fake.close()


def test_chaos_asks_on_a_terminal_and_no_changes_nothing(tmp_path):
    fake = FakeController(tmp_path)
    main, secondary = pty.openpty()
    try:
        os.write(main, b"n\n")
        asked = optimus("chaos", "hang-rank", "--job", "yes", "--rank", "1",
                        url=fake.server.url, stdin=secondary)
        assert asked.returncode == 1 and "Aborted" in asked.stderr
        assert "Chaos on job yes: hang-rank rank 1 (on node1): the rank blocks in its next " \
               "step" in asked.stdout
        assert fake.store.r.llen(fake.store.k("commands:node1")) == 0
    finally:
        os.close(main)
        os.close(secondary)
        fake.close()
