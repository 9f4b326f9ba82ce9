"""What one HTTP client may hold of `brisk serve`: its request body (bytes, JSON nesting), the time
its request head may take to arrive, and the connections open at once. A misbehaving client (a
huge or deeply nested body, a slow-loris trickling its headers) meets these bounds long before it
costs the other clients anything; a normal request never comes near them."""
from __future__ import annotations

from functools import partial

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# A request's body is read into memory before anything else: bounded (a context's worth of text
# is well under 1 MiB; a long chat history under a few)
MAX_BODY_BYTES = 8 << 20
# Arrays and objects inside one another: a JSON schema or tool list nests a few dozen deep at most,
# while Python code walking a much deeper body would run out of stack
MAX_JSON_DEPTH = 128
# A request head (request line and headers) must arrive within this long of the connection
# opening or of the previous response ending; uvicorn itself bounds only the idle wait between requests
HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 16 << 10  # h11's default, stated: a head larger than this is a 400
KEEP_ALIVE_S = 5  # idle time between requests on one connection, as uvicorn's default
# Connections (and requests in flight) at once; beyond it uvicorn answers 503 at once rather than
# holding one more body and task in memory. Far above what the engine serves concurrently.
MAX_CONNECTIONS = 512

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON nests arrays and objects more than limit deep (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


class HeadTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request head: a connection whose head has
    not fully arrived head_timeout_s after the connection opened (or the previous response ended)
    gets a 408 and is closed. Once the head is in, the request runs as uvicorn runs it."""

    def __init__(self, *args, head_timeout_s: float = HEAD_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self._head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        # past IDLE, the client's head arrived and its request is running (or done): not late
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()


def server_options(head_timeout_s: float = HEAD_TIMEOUT_S) -> dict:
    """uvicorn.Config's arguments that bound each client's connections."""
    return dict(http=partial(HeadTimeoutH11, head_timeout_s=head_timeout_s), limit_concurrency=MAX_CONNECTIONS,
                timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEAD_BYTES)
