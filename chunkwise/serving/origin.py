"""Who may call: the Host and Origin a server answers to, the JSON-only
bodies of POSTs, and the routes that need no API key.

  allowed = origin.allowed_hosts("127.0.0.1", ["api.example.com"])
  origin.check(request, allowed)      # ApiError 403 / 415

A web page elsewhere whose name an attacker points at 127.0.0.1 (DNS
rebinding) sends its own name in Host, and its own origin in Origin: both
are refused (403) unless allowed. A browser sends text/plain and forms
across sites without asking first; a POST declared other than JSON is a
415.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from aiohttp import web

from chunkwise.serving import api, explore
from chunkwise.serving.api import ApiError

# Host names a server on loopback answers to (`allowed_hosts`).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def allowed_hosts(host: str, extra: Sequence[str] = ()) -> frozenset | None:
  """The Host names a server bound to `host` answers to: the loopback
  names, `host` itself (unless a wildcard address) and `extra`; None
  (any) where `extra` holds "*"."""
  if "*" in extra:
    return None
  names = set(LOOPBACK_NAMES) | {e.strip().lower() for e in extra if e.strip()}
  if host not in ("", "0.0.0.0", "::"):
    names.add(host.lower())
    if ":" in host and not host.startswith("["):
      names.add(f"[{host.lower()}]")
  return frozenset(names)


def _host_name(value: str) -> str:
  """A Host header's (or an origin's netloc's) name, without its port."""
  value = value.strip().lower()
  if value.startswith("["):
    return value[: value.find("]") + 1] if "]" in value else value
  return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check(request: web.Request, allowed: frozenset | None) -> None:
  """403 for a Host, or a browser's Origin, this server does not answer
  to (`allowed`: None, any); 415 for a POST whose body is declared other
  than JSON."""
  if allowed is not None:
    host = _host_name(request.headers.get("Host", ""))
    if host not in allowed:
      raise ApiError(
        403,
        f"the Host header {host!r} is not one this server answers to "
        "(--allowed_hosts)",
        api.FORBIDDEN,
      )
    origin = request.headers.get("Origin")
    if origin is not None:
      name = _host_name(urllib.parse.urlsplit(origin).netloc)
      if name not in allowed:
        raise ApiError(
          403,
          f"requests from the origin {origin!r} are not allowed "
          "(--allowed_hosts)",
          api.FORBIDDEN,
        )
  if request.method == "POST" and "Content-Type" in request.headers:
    kind = request.content_type
    if kind != "application/json" and not kind.endswith("+json"):
      raise ApiError(
        415,
        f"the body must be JSON (Content-Type: application/json), got {kind!r}",
      )


def public(request: web.Request, public_openapi: bool) -> bool:
  """Whether `request` needs no API key: reading the health check and the
  explorer page's own files (which hold no data: the page asks for the
  key to call the API), and with `public_openapi` the OpenAPI document
  (`POST /` generates: it needs the key)."""
  return request.method in ("GET", "HEAD") and (
    request.path in ("/", "/health")
    or (public_openapi and request.path == "/openapi.json")
    or explore.public(request.path)
  )
