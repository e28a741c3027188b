"""The token explorer: a page at `/explore` that shows each token shaded
by its probability, its alternatives on hover or focus, and scores texts.

  GET /explore              the page (static/explore.html)
  GET /explore/explore.js   its script; /explore/explore.css its style

The page is package data (plain HTML, CSS and JS: no build step, nothing
fetched from elsewhere) and calls this server's own routes as any client
does: TGI's `/generate_stream` for a prompt, OpenAI's `/v1/chat/
completions` for chat messages, `/v1/completions` with `echo` and
`logprobs` to score a text, `/v1/models` and `/info` for its choices. It
holds no secret: the API key the user types is sent with each of its
requests (`Authorization: Bearer`), so the page's own files need none.
Every response carries a Content-Security-Policy that allows scripts,
styles and requests from this origin only (no inline script or style,
no eval, no frames), and the script writes model output as text, never
as markup.
"""

from __future__ import annotations

import importlib.resources

from aiohttp import web

PATH = "/explore"
_TYPES = {
  "explore.html": "text/html",
  "explore.js": "text/javascript",
  "explore.css": "text/css",
}
CSP = "; ".join(
  [
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
    # DOM sinks that parse markup (innerHTML, ...) refuse plain strings
    "require-trusted-types-for 'script'",
  ]
)
HEADERS = {
  "Content-Security-Policy": CSP,
  "X-Content-Type-Options": "nosniff",
  "Referrer-Policy": "no-referrer",
  "Cache-Control": "no-cache",
}


def public(path: str) -> bool:
  """Whether `path` is one of the page's own files (served without the API
  key: they hold no data)."""
  return path == PATH or path.startswith(PATH + "/")


class Explorer:
  """The page's files, read once from the package."""

  def __init__(self):
    root = importlib.resources.files("chunkwise.serving") / "static"
    self.files = {name: (root / name).read_bytes() for name in _TYPES}

  def _file(self, name: str) -> web.Response:
    return web.Response(
      body=self.files[name],
      content_type=_TYPES[name],
      charset="utf-8",
      headers=HEADERS,
    )

  async def page(self, request: web.Request) -> web.Response:
    return self._file("explore.html")

  async def asset(self, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _TYPES or name.endswith(".html"):
      raise web.HTTPNotFound()
    return self._file(name)

  async def slash(self, request: web.Request) -> web.Response:
    # A plain response, not aiohttp's redirect exception: the middleware
    # turns raised HTTP exceptions into JSON errors.
    return web.Response(status=301, headers={"Location": PATH})

  def routes(self) -> list:
    return [
      web.get(PATH, self.page),
      web.get(PATH + "/", self.slash),
      web.get(PATH + "/{name}", self.asset),
    ]
