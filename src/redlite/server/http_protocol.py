"""uvicorn's h11 protocol with a time-out for reading a request's headers, and Nagle's
algorithm off on every TCP connection.

uvicorn serves every connection asynchronously, so a client trickling its headers never blocks
other clients; but by itself it would hold such a connection open forever. Here a timer runs
while a connection waits for (the rest of) a request's headers; when it fires after
``header_timeout_s`` seconds (``--header-timeout-s``) the connection is closed.

Streamed answers are many small writes: with Nagle's algorithm on, a chunk written while the
previous one is unacknowledged waits for the client's delayed ACK (about 40 ms on Linux).
uvloop turns it off on its own; asyncio's transports only for sockets created with an explicit
``IPPROTO_TCP``, which uvicorn's listening socket (and so each accepted one) is not.
"""

from __future__ import annotations

import asyncio
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol + header read time-out; the time-out (seconds) is read from
    ``config.header_timeout_s``."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._header_timeout_s: float = getattr(config, "header_timeout_s", 10.0)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        no_delay(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            # still inside (or before) a request's headers
            if self._header_timer is None and data:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete headers in %.1f s",
                             self._header_timeout_s)
            self.transport.close()


def no_delay(transport) -> None:
    """Turn Nagle's algorithm off (``TCP_NODELAY``) on ``transport``'s socket when it is TCP."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) \
            and sock.type == socket.SOCK_STREAM:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
