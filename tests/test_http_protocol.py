"""The server's HTTP protocol class (redlite.server.http_protocol) on asyncio's own event loop,
which leaves Nagle's algorithm on for uvicorn's sockets."""

import asyncio
import socket

import pytest
import uvicorn
from uvicorn.server import ServerState

from redlite.server.http_protocol import HeaderTimeoutProtocol

pytestmark = pytest.mark.timeout(30)


async def _app(scope, receive, send):  # never called: no request is sent
    raise AssertionError("no request expected")


def test_accepted_connection_has_nagle_off_on_the_asyncio_loop():
    config = uvicorn.Config(_app, loop="asyncio", lifespan="off", log_level="warning")
    config.load()
    config.header_timeout_s = 5.0

    async def accept_one():
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:  # proto 0, as uvicorn's
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            client = socket.create_connection(listener.getsockname())
            accepted, _ = listener.accept()
            try:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
                protocol = HeaderTimeoutProtocol(config, ServerState(), {}, _loop=loop)
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=accepted)
                on = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                transport.close()
                await asyncio.sleep(0)
                return on
            finally:
                client.close()

    assert asyncio.run(accept_one()) != 0
