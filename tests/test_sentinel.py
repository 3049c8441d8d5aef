"""Redis that survives its host (issue 17): a real primary, a replica and three redis-sentinel
processes; `optimus run` trains against a redis+sentinel:// URL and the primary is SIGKILLed
mid-run. The sentinels promote the replica; the controller and the agents follow it, nobody is
excluded, no event is lost, and the one generation trains on to COMPLETED."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import redis
from cluster import (
    ROOT,
    RedisServer,
    SentinelCluster,
    free_port,
    metrics,
    metrics_so_far,
    wait_for,
    write_job,
)

from controller.store.connect import parse_sentinel_url
from controller.store.store import Store, StoreUnavailable, prefix, safe_url

STEPS, KILL_AT = 60, 12
PACE_S = 0.25  # 12 s from the kill to the job's end: four times a failover on a quiet machine
HEARTBEAT_TIMEOUT_S = 3.0  # agents silent longer than this are judged lost (shorter than the
# failover on purpose: judged on the wall clock alone, the failover would cost every node)
DOWN_AFTER_MS = 2500  # a failover longer than that timeout, which must still cost no node

pytestmark = pytest.mark.skipif(not shutil.which("redis-sentinel"),
                                reason="redis-sentinel is not installed (make test installs it)")


@pytest.fixture
def sentinels(tmp_path):
    cluster = SentinelCluster(tmp_path / "redis", down_after_ms=DOWN_AFTER_MS)
    yield cluster
    cluster.stop()


def test_training_rides_out_a_failover_of_the_redis_primary(sentinels, tmp_path):
    run = tmp_path / "run"
    # Every step at least PACE_S (a sleep, not the machine's speed): the job outlasts the
    # failover and the controller's first renewal on the new primary, which the test waits
    # for (a job that stepped through the failover and ended first released its lease).
    pace = [{"kind": "slow_rank", "rank": r, "step": 1, "seconds": PACE_S} for r in (0, 1)]
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, faults=pace,
                    heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    p = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         env={**os.environ, "REDIS_URL": sentinels.url}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: any(m.get("step", 0) >= KILL_AT for m in metrics_so_far(run)), 90,
                 f"step {KILL_AT}")
        old, new = sentinels.primary.port, sentinels.replica.port
        lease_ms = _lease_ttl(new)
        sentinels.primary.kill()
        killed = time.time()
        next_tick = _next_lease_renewal(new, lease_ms)
        output, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    failover_s = next_tick - killed
    print(f"primary killed -> the controller's next tick on the new primary: {failover_s:.2f} s")
    assert p.returncode == 0, output[-5000:]
    assert sentinels.primary_port() == new != old  # the replica was promoted

    store = Store(sentinels.url, "e2e")
    record = store.job_record()
    assert record["state"] == "COMPLETED", (record, output[-3000:])
    assert (record["generation"], record["restarts"]) == ("0", "0")  # never stopped
    assert store.excluded() == {}
    # Training went on through the failover: every step once, with no gap near the kill.
    rows = [m for m in metrics(run) if "loss" in m]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    during = [m["step"] for m in rows if killed <= m["time"] <= next_tick]
    assert during, "no step was logged while the sentinels elected a new primary"
    # Every event the run implies is in the stream: three registrations, the submission, one
    # generation, the completion; a failover adds a duplicate at worst, never a gap.
    kinds = [e["kind"] for _, e in store.events(count=10_000)]
    assert kinds.count("register") >= 3, kinds
    for kind in ("submitted", "generation", "completed"):
        assert kind in kinds, (kind, kinds)
    assert kinds.count("generation") == 1 and "failure" not in kinds, kinds
    # The agents did lose Redis for a while, and came back to the new primary by themselves.
    agents = [(run / "control" / f"agent-node{i}.log").read_text() for i in range(3)]
    assert all("Redis unreachable" in a and "Redis answers again" in a for a in agents)
    # Longer than the heartbeat timeout: judged on the wall clock alone, every node was lost.
    # How much longer is the sentinels' election and the machine's load (printed above), not
    # the controller's: no upper bound is asserted.
    assert failover_s > HEARTBEAT_TIMEOUT_S


def _lease_ttl(port: int) -> int:
    """The controller's lease as the replica sees it: its remaining time in ms."""
    with redis.Redis(port=port, decode_responses=True) as r:
        return wait_for(lambda: max(r.pttl(prefix("e2e") + "leader"), 0), 10, "the lease")


def _next_lease_renewal(port: int, before_ms: int) -> float:
    """When the controller first renews its lease on `port` (the replica, once promoted): the
    lease's remaining time jumps up. Every tick of the controller begins with that renewal."""
    key = prefix("e2e") + "leader"
    low = before_ms
    with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as r:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ttl = r.pttl(key)
            if ttl > low + 200:
                return time.time()
            low = min(low, ttl) if ttl > 0 else low
            time.sleep(0.005)
    raise AssertionError("the controller never renewed its lease on the new primary")


def test_sentinel_urls_keep_the_two_kinds_of_credentials_apart(monkeypatch):
    url = ("redis+sentinel://optimus-agent:s%40cret@[::1]:26380,h2,h3:26381/jobs/2"
           "?sentinel_password=pw&ssl_ca_certs=/etc/ca.pem")
    spec = parse_sentinel_url(url)
    assert spec.sentinels == [("::1", 26380), ("h2", 26379), ("h3", 26381)]
    assert (spec.service, spec.db, spec.tls) == ("jobs", 2, False)
    assert (spec.username, spec.password) == ("optimus-agent", "s@cret")  # the data servers'
    assert spec.sentinel_auth == {"password": "pw"}  # the sentinels' own
    assert spec.options == {"ssl_ca_certs": "/etc/ca.pem"}
    assert safe_url(url) == ("redis+sentinel://optimus-agent:***@[::1]:26380,h2,h3:26381/jobs/"
                             "2?sentinel_password=***&ssl_ca_certs=/etc/ca.pem")
    monkeypatch.setenv("REDIS_SENTINEL_PASSWORD", "from-env")
    spec = parse_sentinel_url("rediss+sentinel://h1/jobs")
    assert (spec.tls, spec.db, spec.username, spec.sentinel_auth) == (
        True, 0, None, {"password": "from-env"})
    for bad in ("redis+sentinel://h1", "redis+sentinel://h1/jobs/x", "redis+sentinel://h:p/s"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)


def _certificates(d) -> None:
    """A CA, and a server certificate for 127.0.0.1 that it signed."""
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=optimus-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext")


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl makes the test certificates")
def test_rediss_trusts_the_ca_file_from_the_url_or_the_environment(tmp_path, monkeypatch):
    _certificates(tmp_path)
    server = RedisServer(tmp_path, "--tls-port", str(port := free_port()), "--tls-cert-file",
                         str(tmp_path / "server.pem"), "--tls-key-file",
                         str(tmp_path / "server.key"), "--tls-auth-clients", "no")
    try:
        url = f"rediss://127.0.0.1:{port}/0"
        Store(f"{url}?ssl_ca_certs={tmp_path / 'ca.pem'}", "tls").ping()
        monkeypatch.setenv("REDIS_CA_FILE", str(tmp_path / "ca.pem"))
        Store(url, "tls").ping()
        monkeypatch.delenv("REDIS_CA_FILE")
        with pytest.raises(StoreUnavailable, match="certificate verify failed"):
            Store(url, "tls", retry_s=0.2).ping()  # the system's CAs do not know ours
    finally:
        server.stop()
