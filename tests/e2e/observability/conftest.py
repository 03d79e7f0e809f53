"""Fixtures for observability tests: in-process exporters and a check that no Prometheus outlives a test."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server


def child_processes(name: str) -> list[int]:
    """Pids of this process's children whose command is ``name`` (zombies included: they were not reaped)."""
    me = str(os.getpid())
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
        except (OSError, IndexError):
            continue
        if fields[1] == me and comm == name:
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(autouse=True)
def no_prometheus_left_running() -> Iterator[None]:
    """Every test ends with its Prometheus stopped and reaped."""
    before = set(child_processes("prometheus"))
    yield
    assert set(child_processes("prometheus")) - before == set(), "a prometheus process outlived its test"


Exporter = Callable[[CollectorRegistry], str]


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    """Serve a registry over real HTTP on loopback (prometheus_client's own server); returns host:port."""
    servers = []

    def serve(registry: CollectorRegistry) -> str:
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append((server, thread))
        return f"127.0.0.1:{server.server_port}"

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
