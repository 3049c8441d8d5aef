"""A rank that comes before its store waits for the listener, not for torch's retry pause.

torch's TCPStore client, refused, tries again after a growing, jittered pause (~0.5-0.7 s on
torch 2.13 for a store 0.05-0.5 s late); optimus/runtime/dist.py `await_listener` looks every
few ms instead (bench/recovery.py measures what a restart saves). These tests assert what it
decides: when it returns, how often it looks, what it raises, and that ranks started in either
order form one group. How fast is the benchmark's business, not theirs.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from optimus.runtime import destroy_distributed, init_distributed, launch_env
from optimus.runtime import dist as runtime_dist
from optimus.supervision.inprocess import peer_failure
from optimus.supervision.ports import unclaimed_port


def test_it_returns_only_once_the_port_listens():
    port = unclaimed_port("127.0.0.1")
    returned: list[float] = []
    waiter = threading.Thread(target=lambda: (
        runtime_dist.await_listener("127.0.0.1", port, 2, timeout_s=60),
        returned.append(time.monotonic())))
    waiter.start()
    time.sleep(0.3)
    assert not returned  # refused so far: still waiting
    listener = socket.create_server(("127.0.0.1", port))
    listening = time.monotonic()
    try:
        waiter.join(timeout=60)
        assert returned and returned[0] >= listening
    finally:
        listener.close()


@pytest.mark.parametrize("world,cap", [(2, 0.01), (1_000, 0.1), (131_072, 1.0)])
def test_the_pause_between_looks_grows_to_a_cap_set_by_the_world_size(monkeypatch, world, cap):
    pauses: list[float] = []
    monkeypatch.setattr(runtime_dist.time, "sleep", pauses.append)
    monkeypatch.setattr(runtime_dist.random, "uniform", lambda low, high: high)  # no jitter
    port = unclaimed_port("127.0.0.1")  # nothing listens: every look is refused
    looks = iter(range(40))
    monkeypatch.setattr(runtime_dist.time, "monotonic",
                        lambda: 0.0 if next(looks, None) is not None else 1e9)
    with pytest.raises(dist.DistNetworkError):
        runtime_dist.await_listener("127.0.0.1", port, world, timeout_s=600)
    assert pauses[0] == pytest.approx(0.002)
    assert all(b >= a for a, b in zip(pauses[:-1], pauses[1:], strict=True))  # never shorter
    assert max(pauses) == pytest.approx(cap)  # 2 ranks: 200 looks a second; 1,000: 10,000


def test_a_store_that_never_listens_is_a_timeout_the_rank_reads_as_a_peers_failure():
    port = unclaimed_port("127.0.0.1")
    with pytest.raises(dist.DistNetworkError, match=f"127.0.0.1:{port}.*timed out") as caught:
        runtime_dist.await_listener("127.0.0.1", port, 2, timeout_s=0.3)
    assert peer_failure(caught.value)  # a rank in process waits for the next generation


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"],
                         ids=["unanswered", "unresolvable"])
def test_an_address_that_cannot_be_reached_is_left_to_the_store_to_report(host):
    """TEST-NET-1 (RFC 5737) answers nothing, or the route is refused; a name that does not
    resolve: either way one look, then the store's own connect, which says why."""
    started = time.monotonic()
    runtime_dist.await_listener(host, 29500, 2, timeout_s=60)
    assert time.monotonic() - started < 30  # returned, did not wait out the minute


def _late_rank_zero(rank: int, world_size: int, port: int) -> float:
    """Both ranks leave the harness's group and form a new one on `port`, rank 0 late."""
    destroy_distributed()
    if rank == 0:
        time.sleep(0.5)
    env = launch_env({"OPTIMUS_RANK": str(rank), "OPTIMUS_WORLD_SIZE": str(world_size),
                      "OPTIMUS_MASTER_ADDR": "127.0.0.1", "OPTIMUS_MASTER_PORT": str(port)})
    init_distributed(env, "gloo", torch.device("cpu"), timeout_s=120)
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    return value.item()


def test_a_rank_that_comes_before_rank_zero_joins_its_group(run_ranks):
    assert run_ranks(_late_rank_zero, 2, unclaimed_port("127.0.0.1"), timeout=180) == [3.0, 3.0]
