"""Shared fixtures. `run_ranks` runs a function on several gloo-connected processes.

`pytest --fast` (`make test-fast`) is the development tier: a test skips at the moment it would
start a process (a subprocess, a multiprocessing child, a fork), so what runs is every test
that needs none, decided by what each test does rather than by a list kept by hand. CI runs
the whole suite (`make test`).
"""

import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Make `optimus` importable without installing it; rank processes inherit this sys.path.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import multiproc  # noqa: E402
from cluster import Processes, RedisServer  # noqa: E402


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


def pytest_configure(config):
    # optimus.runtime.dims names dp as a flattened mesh dim; torch 2.13 warns when it is sliced.
    config.addinivalue_line(
        "filterwarnings", "ignore:Slicing a flattened dim from root mesh:UserWarning"
    )


@pytest.fixture
def run_ranks():
    """`run_ranks(fn, world_size, *args, timeout=60.0)` -> [fn(rank, world_size, *args), ...]."""
    return multiproc.run_ranks


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server on a free port, stopped after the test."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def procs(tmp_path):
    """`optimus` subcommands started as real processes (`procs.start(name, *args)`), all
    stopped after the test."""
    p = Processes(tmp_path)
    yield p
    p.stop_all()
