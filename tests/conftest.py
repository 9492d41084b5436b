"""Shared fixtures. Server processes are started on free loopback ports."""

import pytest

from server_process import ServerProcess


@pytest.fixture(scope="module")
def echo_server():
    """An echo-engine server (rewindable) shared by a test module."""
    with ServerProcess() as server:
        yield server


@pytest.fixture
def start_server():
    """Factory: ``start_server(*cli_args, engine="echo")``; every server is stopped afterwards."""
    servers = []

    def start(*args, engine="echo", **kwargs):
        server = ServerProcess(*args, engine=engine, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
