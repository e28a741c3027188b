"""Running the HTTP server: in the foreground until a signal (`serve`,
what scripts/serve.py runs) or in a background thread (`Background`, for
notebooks and tests).

  serve(ctx, host="127.0.0.1", port=8080)    # until SIGTERM / SIGINT
  running = Background(ctx)                  # a free loopback port
  running.url; running.stop()

Either way the port listens at once and the server is ready once its
engine has warmed up (`Engine.ready`; /health answers 503 "starting"
until then, 200 after), and a stop drains: new requests get 503, running
ones get the grace period to finish, then the engine closes and the port
with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
from collections.abc import Callable, Sequence

from aiohttp import web

from chunkwise.serving.api import Context
from chunkwise.serving.bodies import MAX_BODY_BYTES
from chunkwise.serving.http import Server
from chunkwise.serving.origin import allowed_hosts

log = logging.getLogger("chunkwise.serving")


def serve(
  ctx: Context,
  *,
  host: str = "127.0.0.1",
  port: int = 8080,
  api_key: str | None = None,
  grace: float = 30.0,
  max_body_bytes: int = MAX_BODY_BYTES,
  ready: Callable[[int], None] | None = None,
  extra_hosts: Sequence[str] = (),
  public_openapi: bool = False,
) -> None:
  """Serves until SIGTERM or SIGINT: then stops admitting (503), waits up
  to `grace` seconds for running requests, and returns. The socket listens
  at once (/health answers 503 "starting" while the engine warms up);
  `ready(port)` is called once the engine is ready (port 0 picks a free
  one). Requests must name a loopback host, `host` or one of
  `extra_hosts` ("*": any) in their Host header (`origin.allowed_hosts`)."""
  server = Server(
    ctx,
    api_key=api_key,
    allowed=allowed_hosts(host, extra_hosts),
    public_openapi=public_openapi,
  )
  asyncio.run(
    _main(server, host, port, grace, max_body_bytes, ready, signals=True)
  )


class Background:
  """The server in a background thread (notebooks, tests):

  running = Background(ctx)          # listens on a free loopback port
  OpenAI(base_url=running.url + "/v1", api_key="-")...
  running.stop()                     # drains, closes the engine

  It returns once the engine is ready (warmed up), or with
  `wait_ready=False` as soon as it listens (/health says when it is
  ready).
  """

  def __init__(
    self,
    ctx: Context,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    grace: float = 30.0,
    wait_ready: bool = True,
  ):
    self.server = Server(ctx, api_key=api_key, allowed=allowed_hosts(host))
    self._stop: asyncio.Event | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    started = threading.Event()
    self.url = None

    def listening(bound):
      self.url = f"http://{host}:{bound}"
      if not wait_ready:
        started.set()

    async def main():
      self._loop = asyncio.get_running_loop()
      self._stop = asyncio.Event()
      await _main(
        self.server,
        host,
        port,
        grace,
        MAX_BODY_BYTES,
        lambda _: started.set(),
        stop=self._stop,
        listening=listening,
      )

    self._thread = threading.Thread(
      target=lambda: asyncio.run(main()), name="chunkwise-http", daemon=True
    )
    self._thread.start()
    if not started.wait(600):
      raise RuntimeError("the server did not start (warm up) within 600 s")

  def stop(self) -> None:
    """Stops admitting, lets running requests finish (the grace period),
    closes the engine and the port."""
    if self._thread.is_alive():
      self._loop.call_soon_threadsafe(self._stop.set)
      self._thread.join()


async def watch_loop(metrics, period: float = 0.05) -> None:
  """Times how late the event loop runs a `period` timer, forever
  (`chunkwise:event_loop_lag_seconds` in /metrics): the loop only moves
  bytes, so a lag is work someone put on it, delaying every client."""
  loop = asyncio.get_running_loop()
  while True:
    start = loop.time()
    await asyncio.sleep(period)
    metrics.lagged(max(0.0, loop.time() - start - period))


_FULL_BODY = (
  b'{"error": "too many connections (--max_connections)", '
  b'"error_type": "overloaded"}'
)
_FULL = (
  b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
) % (len(_FULL_BODY), _FULL_BODY)


class _Counted(asyncio.Protocol):
  """aiohttp's protocol for one connection, counted by its site (a
  wrapper: aiohttp's has `__slots__`)."""

  def __init__(self, site, inner):
    self.site, self.inner, self.counted = site, inner, False

  def connection_made(self, transport):
    if self.site.open >= self.site.cap:
      transport.write(_FULL)
      transport.close()
      return
    self.site.open += 1
    self.counted = True
    self.inner.connection_made(transport)

  def connection_lost(self, exc):
    if self.counted:
      self.site.open -= 1
      self.inner.connection_lost(exc)

  def data_received(self, data):
    if self.counted:
      self.inner.data_received(data)

  def eof_received(self):
    return self.inner.eof_received() if self.counted else None

  def pause_writing(self):
    if self.counted:
      self.inner.pause_writing()

  def resume_writing(self):
    if self.counted:
      self.inner.resume_writing()


class _CappedSite(web.TCPSite):
  """A TCP site that holds at most `cap` connections: one more is
  answered 503 and closed before aiohttp reads a byte of it."""

  def __init__(self, runner, host, port, cap: int):
    super().__init__(runner, host, port)
    self.cap, self.open = cap, 0

  async def start(self) -> None:
    await web.BaseSite.start(self)
    server = self._runner.server

    def protocol():
      return _Counted(self, server())

    loop = asyncio.get_running_loop()
    self._server = await loop.create_server(protocol, self._host, self._port)
    self._bound_port = self._server.sockets[0].getsockname()[1]


def _freeze_heap() -> None:
  """What the process holds once it is ready (the model, its tokenizer,
  JAX's programs: millions of objects) is moved out of the cyclic
  collector's sight (`gc.freeze`): a full collection walked all of it,
  over 0.1 s with the GIL held, on whichever thread it fell, the event
  loop's too. Only in a server process of its own (`serve`): a frozen
  object's cycles are never collected."""
  gc.collect()
  gc.freeze()
  log.info(
    "%d objects frozen out of the cyclic collector", gc.get_freeze_count()
  )


async def _main(
  server,
  host,
  port,
  grace,
  max_body_bytes,
  ready,
  *,
  signals=False,
  stop=None,
  listening=None,
):
  runner = web.AppRunner(
    server.app(max_body_bytes),
    handler_cancellation=True,
    access_log=None,
    keepalive_timeout=server.ctx.keepalive_timeout_s,
  )
  await runner.setup()
  site = _CappedSite(runner, host, port, server.ctx.max_connections)
  await site.start()
  bound = site._bound_port
  stop = stop or asyncio.Event()
  loop = asyncio.get_running_loop()
  if signals:
    for sig in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(sig, stop.set)
  engine = server.ctx.engine
  if listening is not None:
    listening(bound)
  if not engine.ready:
    log.info(
      "listening on http://%s:%d, warming up (/health: 503)", host, bound
    )

  watching = []
  # A server of its own process opens once its heap froze; in a process
  # it shares (`Background`), nothing freezes: open with the engine.
  server.opened = not signals

  async def announce():  # once the engine has warmed up
    while not engine.ready:
      await asyncio.sleep(0.05)
    if signals:  # a process of its own (`serve`)
      _freeze_heap()  # (before any request is taken: `Server.ready`)
    server.opened = True
    # (timed from here: warming up and freezing hold the loop, once)
    watching.append(asyncio.create_task(watch_loop(server.metrics)))
    log.info("serving %s on http://%s:%d", server.ctx.model_id, host, bound)
    if ready is not None:
      ready(bound)

  announcing = asyncio.create_task(announce())
  await stop.wait()
  announcing.cancel()
  for task in watching:
    task.cancel()
  log.info("shutting down: finishing running requests (%.0f s grace)", grace)
  server.draining = True
  clean = await loop.run_in_executor(None, server.ctx.engine.close, grace)
  await asyncio.sleep(0.1)  # the last events reach their clients
  await runner.cleanup()
  server.admit.shutdown()
  log.info("stopped (%s)", "clean" if clean else "requests cancelled")
