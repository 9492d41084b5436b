"""Shared fixtures. Server processes are started on free loopback ports."""

import pytest

from server_process import ServerProcess


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report shows every running server's exit status and log tail (a server
    that died mid-response otherwise shows only as a closed connection)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in ServerProcess.running:
            report.sections.append((f"server {server.url}", server.report()))


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
