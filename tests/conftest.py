"""Shared fixtures. `run_ranks` runs a function on several gloo-connected processes.

`pytest --fast` (`make test-fast`) is the development tier: a test skips at the moment it would
start a process (a subprocess, a multiprocessing child, a fork), so what runs is every test
that needs none, decided by what each test does rather than by a list kept by hand. CI runs
the whole suite (`make test`).
"""

import contextlib
import json
import multiprocessing.process
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# One OpenMP thread in every process the suite starts (ranks, agents' warm processes, the
# pytest process itself: set before anything imports torch, which fixes its count at import).
# torch's default of a thread per core makes two ranks on two cores spin-wait for each other's
# cores; a reference run and the faulted run it is compared with then use the same count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU backend checks every vector ISA the CPU's flags name by building and loading a
# probe library for each (ten on this VM, ~1.5 s of gcc apiece) in each kernel cache it finds
# without them: the suite's compiles (a fresh cache per compile-cache test) trust the flags
# instead. The ISA picked is the same (every probe passes here); a compiler that could not
# build it would fail the compile loudly, not change what a test compares.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402

# Make `optimus` importable without installing it; rank processes inherit this sys.path.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import multiproc  # noqa: E402
from cluster import WARM_COMMAND, WARM_SERVER, Processes, RedisServer, relaying  # noqa: E402

from optimus.contract.process import die_with_parent  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: skip each test when it would start a process")


NEEDS_PROCESSES = "starts a process: the full suite (make test) runs it"


_refused = []  # in --fast: whether the running test tried to start a process


def _refuse(*args, **kwargs):
    _refused.append(True)
    pytest.skip(NEEDS_PROCESSES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A refusal caught by the code under test (a save's thread turns it into a failed save)
    still makes the test a skip, not a failure."""
    outcome = yield
    report = outcome.get_result()
    if _refused and report.failed:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1], f"Skipped: {NEEDS_PROCESSES}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In --fast, every way a test (or a fixture it sets up) starts a process skips it instead;
    only while tests run, since pytest-xdist's own start-up runs commands."""
    if not item.config.getoption("fast"):
        yield
        return
    _refused.clear()
    saved = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork
    subprocess.Popen._execute_child = multiprocessing.process.BaseProcess.start = _refuse
    os.fork = _refuse
    try:
        yield
    finally:
        (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start,
         os.fork) = saved


# A file: where each test ran, and when. Written by pytest-xdist's workers only (the main
# process hears of every test too).
TIMELINE = os.environ.get("OPTIMUS_TEST_TIMELINE") if os.environ.get("PYTEST_XDIST_WORKER") \
    else None


_started: dict[str, tuple[float, float]] = {}
_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_own_group: list[Path | None] = []  # this worker's cpuacct group, once tried


def _worker_group() -> Path | None:
    """A cpuacct cgroup (v1) of this worker's own, the worker moved into it, where the machine
    lets it (root): everything the worker's tests start (ranks, agents, Redis, forkservers'
    children) is counted there, whoever reaps it. None elsewhere."""
    if not _own_group:
        group = _CPUACCT / f"optimus-tests-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
            int((group / "cpuacct.usage").read_text())
        except (OSError, ValueError):
            group = None
        _own_group.append(group)
    return _own_group[0]


def _cpu_s() -> float:
    """CPU seconds this worker and all it started have used (its cgroup); without a cgroup,
    the whole machine's busy seconds (/proc/stat: a test's own only with one worker and a
    quiet machine)."""
    group = _worker_group()
    if group is not None:
        return int((group / "cpuacct.usage").read_text()) / 1e9
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def pytest_unconfigure(config):
    if _own_group and _own_group[0] is not None:  # out of it, and it gone once it is empty
        with contextlib.suppress(OSError):
            (_CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            _own_group[0].rmdir()


def pytest_runtest_logstart(nodeid, location):
    if TIMELINE:
        _started[nodeid] = (time.time(), _cpu_s())


def pytest_runtest_logfinish(nodeid, location):
    """With OPTIMUS_TEST_TIMELINE, one JSON line per test (set-up and tear-down included): its
    worker, start, end and CPU seconds (`_cpu_s`): how the workers were kept busy, and what
    each test costs the machine (docs/benchmarks.md)."""
    if TIMELINE and nodeid in _started:
        start, cpu = _started.pop(nodeid)
        with open(TIMELINE, "a") as out:
            out.write(json.dumps({"worker": os.environ["PYTEST_XDIST_WORKER"],
                                  "test": nodeid, "start": start, "end": time.time(),
                                  "cpu_s": round(_cpu_s() - cpu, 2),
                                  "cpu_of": "worker" if _worker_group() else "machine"}) + "\n")


# The files whose tests take longest (wall, measured: docs/benchmarks.md), started first: with
# `--dist loadfile --no-loadscope-reorder` (make test) each worker takes the next file when it
# is nearly free, so the longest begin at once and the short ones fill the gaps, instead of a
# several-minute file starting last and running alone. A file stays in one worker: its tests
# share module-scoped set-up (a live job that later tests build on, a Slurm cluster). A file
# not named here only starts later. The order alternates files that mostly wait (on a control
# plane's timeouts, a paced soak: ~0.4 of a core) with files that compute (compiles, layouts:
# a core or more), so that the two workers do not both wait at once: the first two files go
# to one worker each, and the third waits for whichever of them frees first.
LONGEST_FIRST = ("test_chaos_soak", "test_compile", "test_readme", "test_control_plane",
                 "test_multihost", "test_multihost_faults",
                 "test_moe", "test_detection", "test_parallel_matrix", "test_checkpoint_resume",
                 "test_replicas", "test_replica_train", "test_replica_control",
                 "test_precision", "test_pbs", "test_inprocess", "test_operator",
                 "test_planner", "test_rewind", "test_warm_start", "test_slurm",
                 "test_memory_recovery", "test_clean_exit", "test_health_warm",
                 "test_stability", "test_resize", "test_health", "test_compile_cache",
                 "test_trust_secrets", "test_checkpoint_commit", "test_sentinel")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.stem, len(order)))  # stable: file order


def pytest_configure(config):
    # optimus.runtime.dims names dp as a flattened mesh dim; torch 2.13 warns when it is sliced.
    config.addinivalue_line(
        "filterwarnings", "ignore:Slicing a flattened dim from root mesh:UserWarning"
    )


@pytest.fixture(scope="session", autouse=True)
def warm_server(request, tmp_path_factory):
    """One warm server per test process (tests/warm_zygote.py): every agent the suite starts
    forks its warm process from it instead of paying the trainer's imports again (~5 s of CPU
    each). Agents started before it is listening, and tests that take the variables out of
    an agent's environment, get a fresh warm process, as in production."""
    if request.config.getoption("fast"):
        yield None
        return
    path = f"/tmp/optimus-warm-{os.getpid()}.sock"  # short: an AF_UNIX path is <= 107 bytes
    log = tmp_path_factory.mktemp("warm-server") / "server.log"
    with open(log, "ab") as out:
        server = subprocess.Popen([sys.executable, str(Path(__file__).with_name(
            "warm_zygote.py")), path], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)  # never outlives a test process killed outright
    os.environ[WARM_COMMAND] = json.dumps([sys.executable,
                                           str(Path(__file__).with_name("warm_client.py"))])
    os.environ[WARM_SERVER] = path
    try:
        yield server
    finally:
        os.environ.pop(WARM_COMMAND, None)
        os.environ.pop(WARM_SERVER, None)
        server.kill()
        server.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if TIMELINE:  # each agent refused paid a cold warm process (~3 s of CPU): say why
            refused = Counter(line.removeprefix("refused: ") for line in log.read_text(
                errors="replace").splitlines() if line.startswith("refused: "))
            with open(TIMELINE, "a") as timeline:
                timeline.write(json.dumps({"worker": os.environ["PYTEST_XDIST_WORKER"],
                                           "warm_refused": dict(refused)}) + "\n")


@pytest.fixture
def fresh_warm(monkeypatch):
    """For a test that inspects warm processes (their parent, cmdline, environment) or every
    process a run leaves: agents and spawners it starts get the real
    `python -m optimus.supervision.warm`."""
    monkeypatch.delenv(WARM_COMMAND, raising=False)
    monkeypatch.delenv(WARM_SERVER, raising=False)


@pytest.fixture
def run_ranks():
    """`run_ranks(fn, world_size, *args, timeout=60.0)` -> [fn(rank, world_size, *args), ...]."""
    return multiproc.run_ranks


@pytest.fixture
def run_of(tmp_path):
    """`run_of(steps=..., ...)`: replicas' processes (bench/replica_run.py's `Run`), a quorum
    file and store, as a controller would hold them; every process killed after the test."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from replica_run import Run
    runs = []

    def make(**kw) -> Run:
        runs.append(Run(tmp_path, **kw))
        return runs[-1]
    yield make
    for r in runs:
        r.kill_all()


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server on a free port, stopped after the test."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def relayed(redis_server):
    """`relayed(job)`: the controller's relay for a job whose agents run with no controller
    (tests/cluster.py `relaying`), until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda job: stack.enter_context(relaying(redis_server.url, job))


@pytest.fixture
def procs(tmp_path):
    """`optimus` subcommands started as real processes (`procs.start(name, *args)`), all
    stopped after the test."""
    p = Processes(tmp_path)
    yield p
    p.stop_all()


@pytest.fixture
def socket_dir():
    """A folder for an agent's AF_UNIX socket, short enough for one (108 bytes with its name,
    which a tmp_path deep in pytest's numbered folders may not leave), removed after."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="os-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
