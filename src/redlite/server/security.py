"""Security defaults of a server people leave running: API keys, Host check, JSON-only bodies.

* API keys (``--api-key``, ``--api-key-file``): every route but ``GET``/``HEAD /health``
  needs ``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic
  clients); keys are compared in constant time (:func:`hmac.compare_digest`, every key
  compared); 401 otherwise.
* Host check (DNS rebinding): when bound to a loopback address (or with ``--allowed-host``),
  the ``Host`` header must name ``localhost``, ``127.0.0.1``, ``[::1]`` (any port) or an
  ``--allowed-host``; 403 otherwise. A web page that rebinds its own name to 127.0.0.1 still
  sends its own name as Host.
* JSON bodies (:func:`require_json`, called by the routes): a ``POST`` must declare ``application/json`` (parameters such as
  ``charset=utf-8`` allowed) or a ``+json`` type; 415 otherwise. A cross-site page can only
  send ``text/plain``, form or multipart bodies without a CORS preflight, so this refuses every
  cross-site "simple" request that could run a generation or write a slot file.
* CORS headers only for ``--cors-origin`` origins (Starlette's CORSMiddleware, added by
  :func:`redlite.server.app.create_app`).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path

from redlite.server.errors import send_error

log = logging.getLogger("redlite.server")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


@dataclass
class SecurityOptions:
    """api_keys: accepted keys (empty: no authentication). allowed_hosts: Host names accepted
    besides the loopback names, lower case, without port. check_host: whether the Host header
    is checked at all (loopback bind or ``--allowed-host`` given). cors_origins: origins that
    get CORS headers (empty: none)."""

    api_keys: list[str] = field(default_factory=list)
    check_host: bool = False
    allowed_hosts: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback-only (``localhost``, ``127.x``, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_key_file(path: str) -> list[str]:
    """API keys from ``path``, one per line (blank lines and ``#`` comments skipped).
    Raises OSError when unreadable, ValueError when it holds no key."""
    keys = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


def security_from_args(args) -> SecurityOptions:
    """SecurityOptions from the ``serve`` options; logs a warning for a non-loopback bind
    without a key. Raises OSError/ValueError for an unusable ``--api-key-file``."""
    keys = [key for key in (args.api_key or []) if key]
    for path in args.api_key_file or []:
        keys += read_key_file(path)
    loopback = is_loopback(args.host)
    if not loopback and not keys:
        log.warning("listening on %s without an API key: anyone who can reach this address can "
                    "run generations and use the slot API; pass --api-key or --api-key-file",
                    args.host)
    allowed = [host.lower() for host in (args.allowed_host or [])]
    return SecurityOptions(api_keys=keys, check_host=loopback or bool(allowed),
                           allowed_hosts=allowed, cors_origins=list(args.cors_origin or []))


def host_name(value: str) -> str:
    """The host part of a ``Host`` header value, lower case: ``[::1]:8080`` -> ``[::1]``,
    ``Localhost:80`` -> ``localhost``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[:value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers") or []}


def is_json_type(content_type: str) -> bool:
    """``application/json`` or ``*/*+json``, parameters allowed, case-insensitive."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def require_json(headers) -> None:
    """Raise APIError 415 unless the request declares a JSON body (``headers``: a Starlette
    Headers mapping). Called by every route that takes a body, after routing, so a wrong
    method or path is still a 405 or 404."""
    from redlite.server.errors import APIError

    if not is_json_type(headers.get("content-type", "")):
        raise APIError(415, "the request body must be JSON, sent with "
                       "'Content-Type: application/json'", None, "unsupported_media_type")


class SecurityMiddleware:
    """Pure ASGI middleware applying :class:`SecurityOptions` (Host, then key); sits inside
    the CORS middleware so preflights are answered before any key check."""

    def __init__(self, app, options: SecurityOptions) -> None:
        self.app, self.options = app, options
        self._keys = [key.encode() for key in options.api_keys]
        self._hosts = set(LOOPBACK_NAMES) | set(options.allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if self.options.check_host:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self._hosts:
                await send_error(send, scope, 403, "this Host is not allowed; start the server "
                                 "with --allowed-host NAME to serve it", None, "invalid_host")
                return
        public = scope["method"] in ("GET", "HEAD") and scope["path"] == "/health"
        if self._keys and not public and not self._authorized(headers):
            await send_error(send, scope, 401, "invalid or missing API key: send "
                             "'Authorization: Bearer KEY' or 'x-api-key: KEY'", None,
                             "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        offered = []
        authorization = headers.get(b"authorization", b"")
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            offered.append(token.strip())
        if headers.get(b"x-api-key"):
            offered.append(headers[b"x-api-key"].strip())
        ok = False
        for candidate in offered:
            for key in self._keys:
                ok |= hmac.compare_digest(candidate, key)
        return ok
