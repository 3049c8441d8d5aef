"""Credentials stay where they belong (the trust-boundaries issue, items 3, 6, 7, 9 and 11).

No password or snapshot secret on any command line, screen, log or event of a real `optimus run`
(its whole process tree read from /proc while the ranks run), none in the ranks' environment;
its private Redis refuses a client without the password; URLs are masked, query included; a
command Redis refuses (NOPERM, WRONGPASS, NOAUTH) is its own error, said in one line and never
retried as an outage, and an agent that cannot run the job stops it through keys the shipped
ACL lets it write; the agent's folders are its own; the PBS script runs no command with a
password or the snapshot secret in its arguments.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from cluster import ROOT, Processes, RedisServer, free_port, wait_for, write_job

from controller.store.store import Store, StoreUnavailable

SECRET_KEYS = ("REDIS_URL", "OPTIMUS_SNAPSHOT_SECRET", "OPTIMUS_SNAPSHOT_SECRET_FILE",
               "REDIS_SENTINEL_PASSWORD")


# --- /proc --------------------------------------------------------------------------------------

def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _tree(root: int) -> dict[int, int]:
    """`root` and every process below it (by parent pid: sessions do not matter): pid -> ppid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat_line = _read(f"/proc/{entry}/stat").decode(errors="replace")
            if stat_line:
                ppid = int(stat_line.rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = {root: 0}, [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found[child] = pid
            todo.append(child)
    return found


def _environ(raw: bytes) -> dict[str, str]:
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


# --- a real `optimus run` -----------------------------------------------------------------------

@pytest.mark.usefixtures("fresh_warm")  # the warm processes' own environments are read
def test_optimus_run_shows_no_secret_anywhere_and_its_redis_wants_the_password(tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, name="secrets", steps=12, stop_grace_s=5.0)
    env = {k: v for k, v in os.environ.items() if k not in SECRET_KEYS}
    out_path = tmp_path / "stdout.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes",
                                 "2", "--ranks-per-node", "1"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, tuple[bytes, bytes]] = {}  # pid -> (cmdline, environ), as last read
    parents: dict[int, int] = {}
    unauthenticated = None
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            for pid, ppid in _tree(proc.pid).items():
                cmdline, environ = _read(f"/proc/{pid}/cmdline"), _read(f"/proc/{pid}/environ")
                if cmdline:
                    seen[pid], parents[pid] = (cmdline, environ), ppid
            urls = [_environ(e).get("REDIS_URL") for _, e in seen.values()]
            url = next((u for u in urls if u), None)
            if url and unauthenticated is None:
                try:
                    redis.Redis(host="127.0.0.1", port=urlsplit(url).port).ping()
                    unauthenticated = "answered"
                except redis.AuthenticationError as e:
                    unauthenticated = str(e)
            time.sleep(0.1)
        assert proc.wait(timeout=60) == 0, out_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stdout = out_path.read_text()

    environs = {pid: _environ(e) for pid, (_, e) in seen.items()}
    urls = {e["REDIS_URL"] for e in environs.values() if e.get("REDIS_URL")}
    # By environment: the controller's (the default user), and each agent a user of its node.
    users = {urlsplit(u).username: urlsplit(u).password for u in urls}
    assert sorted(users) == ["default", "optimus-node-node0", "optimus-node-node1"], urls
    assert len(set(users.values())) == 3, "a password of its own for each identity"
    assert len({urlsplit(u).port for u in urls}) == 1
    passwords = list(users.values())
    password = users["default"]
    assert all(len(p) >= 32 for p in passwords), "generated passwords, even on loopback"
    secrets = {e["OPTIMUS_SNAPSHOT_SECRET"] for e in environs.values()
               if e.get("OPTIMUS_SNAPSHOT_SECRET")}
    assert len(secrets) == 1, "one random snapshot secret per run, handed to every agent"
    secret = secrets.pop()
    assert len(secret) >= 64
    assert unauthenticated is not None and unauthenticated != "answered"

    for pid, (cmdline, _) in seen.items():
        text = cmdline.replace(b"\0", b" ").decode(errors="replace")
        assert not any(p in text for p in [*passwords, secret]), f"pid {pid}: {text}"
    # The ranks' side: the warm processes, the ranks forked from them (whose /proc environ is
    # the warm process's), standbys, and any rank started cold.
    side = {pid for pid, (cmdline, _) in seen.items()
            if b"optimus.supervision.warm" in cmdline or b"optimus\0train" in cmdline}
    ranks = {pid for pid in side if parents[pid] in side or b"optimus\0train" in seen[pid][0]}
    assert len(ranks) >= 2, "both ranks were read"
    for pid in side:
        e = environs[pid]
        assert not set(SECRET_KEYS) & set(e), f"pid {pid} inherits {set(SECRET_KEYS) & set(e)}"
        raw = seen[pid][1].decode(errors="replace")
        assert not any(p in raw for p in [*passwords, secret])

    banner = stdout.splitlines()[0]
    assert "Redis redis://default:***@127.0.0.1:" in banner, banner
    assert not any(p in stdout for p in [*passwords, secret])
    env_file = run / "control" / "redis.env"  # for operators: the one place the URL is kept
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert f"export REDIS_URL=redis://default:{password}@" in env_file.read_text()
    for path in _files(run):
        if path != env_file:
            text = path.read_bytes().decode(errors="replace")
            assert not any(p in text for p in [*passwords, secret]), f"{path} holds a secret"


def test_safe_url_masks_passwords_in_the_query_too():
    from controller.store.connect import safe_url

    assert safe_url("redis://h:6379/0?password=pw1") == "redis://h:6379/0?password=***"
    assert (safe_url("redis://u:pw2@h:6379/0?ssl_ca_certs=/ca.pem&password=pw3&db=1")
            == "redis://u:***@h:6379/0?ssl_ca_certs=/ca.pem&password=***&db=1")
    masked = safe_url("rediss+sentinel://u:a@s1,s2/svc?sentinel_password=b&token=c&api_key=d"
                      "&client_secret=e&auth=f")
    assert not {"a", "b", "c", "d", "e", "f"} & set(re.findall(r"=(\w+)", masked))
    assert masked.startswith("rediss+sentinel://u:***@s1,s2/svc?")


# --- refused commands -----------------------------------------------------------------------------

ADMIN_PW = "admin-pw-0123456789"


def _acl_server(tmp_path: Path) -> tuple[RedisServer, dict[str, str]]:
    """A redis-server with the users of deploy/redis-users.acl; each user's URL."""
    acl = (ROOT / "deploy" / "redis-users.acl").read_text()
    for user in ("controller", "agent", "operator"):
        acl = acl.replace(f"CHANGE-ME-{user}", f"{user}-pw-0123456789")
    acl += f"user test-admin on >{ADMIN_PW} ~* &* +@all\n"  # the test's own, to read counts
    (tmp_path / "users.acl").write_text(acl)
    server = RedisServer(tmp_path / "redis", "--aclfile", str(tmp_path / "users.acl"))
    return server, {u: f"redis://optimus-{u}:{u}-pw-0123456789@127.0.0.1:{server.port}/0"
                    for u in ("controller", "agent", "operator")}


def test_a_refused_command_is_said_in_one_line_and_not_retried(tmp_path):
    from controller.store.connect import Denied

    server, url = _acl_server(tmp_path)
    try:
        agent = Store(url["agent"], "j", retry_s=5.0)
        with pytest.raises(Denied) as denied:
            agent.update_job({"state": "FAILED"})  # the controller's key: not an agent's
        # Sent once: the server refused one HSET (a retry as if Redis were down would have
        # sent it again for 5 s), counted by the server, however loaded the machine.
        admin = redis.Redis(port=server.port, username="test-admin", password=ADMIN_PW)
        with admin:
            assert admin.info("commandstats")["cmdstat_hset"]["rejected_calls"] == 1, \
                "retried as if Redis were down"
        assert not isinstance(denied.value, StoreUnavailable)
        line = str(denied.value)
        assert "\n" not in line and "agent-pw" not in line
        assert "NOPERM" in line and "user optimus-agent" in line and "HSET" in line
        assert "optimus:{j}:job" in line

        wrong = Store(url["agent"].replace("agent-pw", "wrong-pw"), "j", retry_s=5.0)
        with pytest.raises(Denied, match="WRONGPASS") as denied:
            wrong.ping()
        assert "user optimus-agent" in str(denied.value) and "wrong-pw" not in str(denied.value)
        nobody = Store(f"redis://127.0.0.1:{server.port}/0", "j", retry_s=5.0)
        with pytest.raises(Denied, match="NOAUTH"):
            nobody.ping()

        # The CLI says it in one line, exit status 2, and names the command refused.
        done = subprocess.run([sys.executable, "-m", "controller", "job", "stop", "--job", "j",
                               "--yes", "--reason", "x"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60,
                              env={**os.environ, "REDIS_URL": url["agent"]})
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "NOPERM" in done.stderr and "optimus-agent" in done.stderr
        assert "agent-pw" not in done.stderr and "Traceback" not in done.stderr

        # So does an agent, at once, rather than riding it out as an outage.
        done = subprocess.run([sys.executable, "-m", "controller", "agent", "--job", "j",
                               "--node", "n0"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "REDIS_URL": url["operator"]})
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and last.startswith("error: Redis at "), done.stderr
        assert "refused MULTI to user optimus-operator (NOPERM" in last
        assert "unreachable" not in done.stderr and "Traceback" not in done.stderr
    finally:
        server.stop()


def test_a_password_on_the_command_line_is_warned_about():
    url = f"redis://u:pw-on-argv@127.0.0.1:{free_port()}/0"  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "controller", "health-check", "--job", "j",
                           "--redis", url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    warning, error = done.stderr.strip().splitlines()
    assert warning.startswith("warning: --redis carries a password") and "REDIS_URL" in warning
    assert error.startswith("error: nothing listens at redis://u:***@127.0.0.1:")
    assert "pw-on-argv" not in done.stderr


def test_an_agent_that_cannot_run_the_job_stops_it_under_the_shipped_acl(tmp_path):
    """float8 asked where torchao is missing (made unimportable in the agent only): the agent
    refuses the generation through its own record, which its ACL user may write, and the
    controller stops the job with the reason; nothing is denied, nothing called an outage."""
    server, url = _acl_server(tmp_path)
    procs = Processes(tmp_path)
    run = tmp_path / "run"
    # The agent's float8 check imports torch: seconds without a beat on two busy cores.
    job = write_job(tmp_path / "job.yaml", run, name="f8", steps=10, heartbeat_timeout_s=60.0)
    raw = yaml.safe_load(job.read_text())
    raw["training"] = {"float8": "tensorwise"}
    raw["parallel"]["device"] = "cpu"
    job.write_text(yaml.safe_dump(raw))
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torchao.py").write_text("raise ImportError('no torchao on this node (test)')\n")
    try:
        procs.start("controller", "controller", str(job), "--nodes", "1", "--ranks-per-node",
                    "1", "--exit-when-done", "--metrics-port", "0",
                    env={"REDIS_URL": url["controller"]})
        procs.start("agent", "agent", "--job", "f8", "--node", "node0", "--interval", "0.25",
                    env={"REDIS_URL": url["agent"], "PYTHONPATH": f"{shadow}:{ROOT}"})
        operator = Store(url["operator"], "f8")
        wait_for(lambda: operator.job_record().get("state") == "STOPPED", 90,
                 "the job STOPPED by the agent's refusal")
        stops = [e["message"] for _, e in operator.events(count=1000) if e["kind"] == "stop"]
        assert len(stops) == 1 and stops[0].startswith("stop asked by agent:node0@"), stops
        assert "training.float8: tensorwise cannot run here: torchao is not installed" in stops[0]
        log = procs.log("agent")
        assert "unreachable" not in log and "NOPERM" not in log, log[-2000:]
    finally:
        procs.stop_all()
        server.stop()


# --- the agent's folders ------------------------------------------------------------------------

def test_the_agents_folders_are_private_or_refused(tmp_path):
    from controller.node.folders import UnsafeFolder, private_folder

    fresh = private_folder(tmp_path / "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700 and fresh.stat().st_uid == os.getuid()
    older = tmp_path / "older"  # made by an earlier version (0755): ours, tightened
    older.mkdir(mode=0o755)
    older.chmod(0o755)
    assert stat.S_IMODE(private_folder(older).stat().st_mode) == 0o700

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(UnsafeFolder) as refused:
        private_folder(open_to_all)
    line = str(refused.value)
    assert "\n" not in line and str(open_to_all) in line and "0777" in line

    if os.getuid() == 0:  # only root can hand a folder to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UnsafeFolder, match="uid 65534"):
            private_folder(theirs)
    link = tmp_path / "link"
    link.symlink_to(fresh)
    with pytest.raises(UnsafeFolder, match="not a folder"):
        private_folder(link)


def test_an_agent_refuses_a_socket_folder_others_can_write(tmp_path, redis_server):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    planted = tmp / f"optimus-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    done = subprocess.run([sys.executable, "-m", "controller", "agent", "--job", "j", "--node",
                           "n0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp), "REDIS_URL": redis_server.url})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and str(planted) in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_ranks_get_no_redis_url_and_no_secret():
    from controller.node.spawn import rank_environment

    base = {"PATH": "/bin", "REDIS_URL": "redis://u:pw@h/0", "REDIS_SENTINEL_PASSWORD": "s",
            "OPTIMUS_SNAPSHOT_SECRET": "k", "OPTIMUS_SNAPSHOT_SECRET_FILE": "/f",
            "REDIS_CA_FILE": "/ca", "OPTIMUS_RANK": "0"}
    assert rank_environment(base) == {"PATH": "/bin", "OPTIMUS_RANK": "0"}


# --- the batch scripts --------------------------------------------------------------------------

BUILTINS = {"echo", "printf", "[[", "[", "test", "local", "read", "export", "set", "trap",
            "kill", "wait", "cd", "return", "true", "false", ":", "exit", "mapfile", "shift",
            "source", "."}


def _arguments_with(trace: str, secrets: list[str]) -> list[str]:
    """The traced commands (bash -x) that are programs, not builtins, whose arguments hold a
    secret. Assignments before a command are its environment, not its arguments."""
    found = []
    for line in trace.splitlines():
        m = re.match(r"^\++ (.*)$", line)
        if not m:
            continue
        try:
            words = shlex.split(m.group(1))
        except ValueError:
            words = m.group(1).split()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)
        if words and words[0] not in BUILTINS and any(s in " ".join(words) for s in secrets):
            found.append(m.group(1))
    return found


def test_the_pbs_script_runs_no_command_with_a_secret_in_its_arguments(tmp_path):
    from controller.schedulers.pbs import SCRIPT

    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, name="pbs-secrets", steps=6)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\n")
    env = {**{k: v for k, v in os.environ.items() if k not in SECRET_KEYS},
           "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "401.fake",
           "PBS_O_WORKDIR": str(tmp_path), "FAKE_MPIEXEC_LOG": str(tmp_path / "mpiexec.log"),
           "PATH": f"{ROOT / 'tests' / 'fake_pals'}:{Path(sys.executable).parent}:"
                   f"{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "OPTIMUS_JOB_FILE": str(job), "OPTIMUS_NODES": "1",
           "OPTIMUS_RANKS_PER_NODE": "1", "OPTIMUS_HOME": str(ROOT),
           "OPTIMUS_PYTHON": sys.executable, "OPTIMUS_REDIS_PORT": str(free_port())}
    proc = subprocess.Popen(["bash", "-x", str(SCRIPT)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        trace, _ = proc.communicate(timeout=150)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
        proc.wait()
    assert proc.returncode == 0, trace[-3000:]
    assert "job pbs-secrets ended COMPLETED" in trace
    passwords = [line.split()[1] for line in (run / "redis" / "passwords").read_text()
                 .splitlines()]
    assert len(passwords) == 3 and _arguments_with(trace, passwords) == []
    snapshot = re.findall(r"OPTIMUS_SNAPSHOT_SECRET=([0-9a-f]{64})\b", trace)
    assert snapshot, "the script makes a snapshot secret per allocation"
    assert _arguments_with(trace, snapshot) == []
    lines = trace.splitlines()
    (agents,) = [i for i, line in enumerate(lines) if "mpiexec" in line and "--hostfile" in line]
    # The agents' mpiexec runs in the background: its subshell traces the assignment, then the
    # command, while the script's own trace lines may fall between the two.
    (given,) = [i for i, line in enumerate(lines)
                if line == f"+ OPTIMUS_SNAPSHOT_SECRET={snapshot[0]}"]  # its environment
    assert given < agents
    assert sum("OPTIMUS_SNAPSHOT_SECRET" in line for line in lines) == 1, "the agents' alone"


def test_the_slurm_script_hands_secrets_by_environment_only():
    text = (ROOT / "deploy" / "slurm" / "optimus.sbatch").read_text()
    assert "--requirepass" not in text and "sed -e" not in text
    agents = text[text.index("# --- one agent per node"):text.index("AGENTS=$!")]
    before = agents.split("srun --nodes", 1)[0]
    assert "OPTIMUS_SNAPSHOT_SECRET=$SNAPSHOT_SECRET" in before, "set for the agents' srun only"
    assert "SNAPSHOT_SECRET=$(od -An -N32 -tx1 /dev/urandom" in before  # one per allocation
    assert 'export REDIS_URL=' in text  # operator.env, sourced, exports the URL
