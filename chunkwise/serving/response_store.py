"""Stored responses of the Responses API, in SQLite (the standard
library's `sqlite3`, write-ahead log).

  store = ResponseStore("~/.cache/chunkwise/state", max_mb=256, max_days=30)
  store.put(rid, response, input_items, history)   # one transaction
  store.get(rid)            # the response object, or None
  store.input_items(rid)    # this turn's input items, or None
  store.history(rid)        # every item of the conversation so far
  store.delete(rid)         # True if it was there

One row per response: the response object as the client got it, the
input items of its own turn, and the conversation's items up to its
output (`previous_response_id` continues from those). A row is written in
one committed transaction (WAL, `synchronous=FULL`): a server killed
mid-write loses only the row it was writing, never a committed one, and
a restarted server reads every committed row. Eviction (on every write,
oldest first): rows older than `max_days`, then the oldest rows while the
database holds more than `max_mb` of rows. The store is used from the
server's executor threads; each call opens no new connection (one,
serialized by a lock).
"""

from __future__ import annotations

import json
import os
import pathlib
import sqlite3
import threading
import time
from typing import Any

FILE = "responses.sqlite3"


def default_dir() -> str:
  """$CHUNKWISE_STATE_DIR, else $XDG_STATE_HOME/chunkwise, else
  $XDG_CACHE_HOME/chunkwise/state, else ~/.cache/chunkwise/state (beside
  the compilation cache)."""
  env = os.environ
  if env.get("CHUNKWISE_STATE_DIR"):
    return env["CHUNKWISE_STATE_DIR"]
  if env.get("XDG_STATE_HOME"):
    return str(pathlib.Path(env["XDG_STATE_HOME"]) / "chunkwise")
  cache = env.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return str(pathlib.Path(cache) / "chunkwise" / "state")


class ResponseStore:
  """Responses kept in `directory`/responses.sqlite3 (see the module)."""

  def __init__(
    self, directory: str, *, max_mb: float = 256.0, max_days: float = 30.0
  ):
    if max_mb <= 0 or max_days <= 0:
      raise ValueError(
        f"the response store's limits must be positive: max_mb={max_mb}, "
        f"max_days={max_days}"
      )
    path = pathlib.Path(directory).expanduser()
    try:
      path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ValueError(f"cannot make the state directory {path}: {e}") from e
    self.path = path / FILE
    self.max_bytes = int(max_mb * (1 << 20))
    self.max_age_s = max_days * 86400.0
    self._lock = threading.Lock()
    try:
      self._db = sqlite3.connect(
        self.path, check_same_thread=False, isolation_level=None
      )
      self._db.execute("PRAGMA journal_mode=WAL")
      self._db.execute("PRAGMA synchronous=FULL")
      self._db.execute(
        "CREATE TABLE IF NOT EXISTS responses ("
        " id TEXT PRIMARY KEY,"
        " created REAL NOT NULL,"
        " bytes INTEGER NOT NULL,"
        " response TEXT NOT NULL,"
        " input_items TEXT NOT NULL,"
        " history TEXT NOT NULL)"
      )
      self._db.execute(
        "CREATE INDEX IF NOT EXISTS by_created ON responses (created)"
      )
    except sqlite3.Error as e:
      raise ValueError(
        f"cannot open the response store {self.path}: {e}"
      ) from e

  def put(
    self,
    rid: str,
    response: dict,
    input_items: list[dict],
    history: list[dict],
  ) -> None:
    """Stores one response (committed when this returns), then evicts."""
    texts = [
      json.dumps(x, separators=(",", ":"))
      for x in (response, input_items, history)
    ]
    size = sum(len(t) for t in texts)
    with self._lock:
      self._db.execute("BEGIN IMMEDIATE")
      try:
        self._db.execute(
          "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
          (rid, time.time(), size, *texts),
        )
        self._evict()
        self._db.execute("COMMIT")
      except BaseException:
        self._db.execute("ROLLBACK")
        raise

  def _evict(self) -> None:
    self._db.execute(
      "DELETE FROM responses WHERE created < ?",
      (time.time() - self.max_age_s,),
    )
    (total,) = self._db.execute(
      "SELECT COALESCE(SUM(bytes), 0) FROM responses"
    ).fetchone()
    if total <= self.max_bytes:
      return
    over = total - self.max_bytes
    rows = self._db.execute(
      "SELECT id, bytes FROM responses ORDER BY created"
    ).fetchall()
    gone = []
    for rid, size in rows:
      if over <= 0:
        break
      gone.append((rid,))
      over -= size
    self._db.executemany("DELETE FROM responses WHERE id = ?", gone)

  def _column(self, rid: str, column: str) -> Any:
    with self._lock:
      row = self._db.execute(
        f"SELECT {column} FROM responses WHERE id = ?", (rid,)
      ).fetchone()
    return None if row is None else json.loads(row[0])

  def get(self, rid: str) -> dict | None:
    return self._column(rid, "response")

  def input_items(self, rid: str) -> list[dict] | None:
    return self._column(rid, "input_items")

  def history(self, rid: str) -> list[dict] | None:
    return self._column(rid, "history")

  def delete(self, rid: str) -> bool:
    with self._lock:
      cursor = self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
    return cursor.rowcount > 0

  def count(self) -> int:
    with self._lock:
      return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

  def close(self) -> None:
    with self._lock:
      self._db.close()
