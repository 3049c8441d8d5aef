"""Shared fixtures. `run_ranks` runs a function on several gloo-connected processes."""

import sys
from pathlib import Path

import pytest

# Make `optimus` importable without installing it; rank processes inherit this sys.path.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import multiproc  # noqa: E402
from cluster import Processes, RedisServer  # noqa: E402


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
