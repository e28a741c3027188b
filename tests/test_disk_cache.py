"""Compiled constraint tables on disk: reused across processes, never read
when damaged or built by other code. The eager tables (the plain twin)
here; a lazy constraint's byte DFA is stored the same way (its last
test)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chunkwise as cw
from chunkwise import constraints as C
from chunkwise.constraints import disk_cache, tables, worker

REGEX = r"(cat|dog)s? [0-9]{1,3}"


@pytest.fixture(autouse=True)
def eager(monkeypatch):
  monkeypatch.setattr(C.constraint, "TABLES", "eager")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("CHUNKWISE_CONSTRAINT_CACHE", str(tmp_path))
  tables.clear_cache()
  yield tmp_path
  tables.clear_cache()


def _compile():
  return C.Regex(REGEX).compile(cw.ByteVocabulary(), stop_ids=[2], width=320)


def _no_worker(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the worker was asked to build a cached table")

  monkeypatch.setattr(worker, "run", refuse)


def _same(a, b):
  assert a.regex == b.regex
  for name in disk_cache.FIELDS:
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def _another_process(script: str, cache_dir) -> list[str]:
  """What `script` prints, run by another Python on `cache_dir`."""
  env = {**os.environ, "CHUNKWISE_CONSTRAINT_CACHE": str(cache_dir)}
  return subprocess.run(
    [sys.executable, "-c", script],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()


def test_a_second_process_reads_what_the_first_built(cache_dir):
  built = _compile()
  (entry,) = cache_dir.glob("*.npz")
  script = textwrap.dedent(f"""
    import chunkwise as cw
    from chunkwise import constraints as C
    from chunkwise.constraints import worker
    C.constraint.TABLES = {C.constraint.TABLES!r}
    t = C.Regex({REGEX!r}).compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
    print(worker.pid(), t.states, getattr(t, "classes", None))
  """)
  out = _another_process(script, cache_dir)
  # No compile worker was started: the tables came from the file.
  classes = getattr(built, "classes", None)
  assert out == ["None", str(built.states), str(classes)]
  assert list(cache_dir.glob("*.npz")) == [entry]


def test_a_lazy_constraint_reads_its_dfa_and_trie_back(cache_dir, monkeypatch):
  """A lazy constraint keeps two entries: its byte DFA and the
  vocabulary's trie; another process builds neither."""
  monkeypatch.setattr(C.constraint, "TABLES", "lazy")
  built = _compile()
  entries = sorted(p.name for p in cache_dir.glob("*.npz"))
  assert len(entries) == 2 and sum(e.startswith("trie-") for e in entries) == 1
  script = textwrap.dedent(f"""
    import chunkwise as cw
    from chunkwise import constraints as C
    from chunkwise.constraints import token_trie, worker
    built = []
    token_trie.build = lambda *a: built.append(a)
    t = C.Regex({REGEX!r}).compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
    print(worker.pid(), t.states, len(built), t.trie.nodes)
  """)
  out = _another_process(script, cache_dir)
  assert out == ["None", str(built.states), "0", str(built.trie.nodes)]
  assert sorted(p.name for p in cache_dir.glob("*.npz")) == entries
  # a damaged trie entry is built again
  (trie,) = cache_dir.glob("trie-*.npz")
  trie.write_bytes(trie.read_bytes()[:200])
  C.lazy.clear_cache()
  monkeypatch.setattr(C.token_trie, "_CACHE", {})
  assert _compile().trie.nodes == built.trie.nodes


def test_a_damaged_dfa_entry_is_rebuilt(cache_dir, monkeypatch):
  """A byte DFA entry whose next states point past its states is not
  read: the DFA is built again, and written whole."""
  monkeypatch.setattr(C.constraint, "TABLES", "lazy")
  C.lazy.clear_cache()
  built = _compile()
  (entry,) = (
    p for p in cache_dir.glob("*.npz") if not p.name.startswith("trie-")
  )
  with np.load(entry) as f:
    arrays = dict(f)
  arrays["table"] = arrays["table"] + 1000
  with open(entry, "wb") as f:
    np.savez(f, **arrays)
  C.lazy.clear_cache()
  again = _compile()
  np.testing.assert_array_equal(again.dfa.table, built.dfa.table)
  with np.load(entry) as f:
    np.testing.assert_array_equal(f["table"], built.dfa.table)


def test_entries_are_read_back_exactly(cache_dir, monkeypatch):
  built = _compile()
  tables.clear_cache()  # memory only
  _no_worker(monkeypatch)
  _same(_compile(), built)


@pytest.mark.parametrize("damage", ["truncated", "inconsistent", "not npz"])
def test_a_damaged_entry_is_rebuilt(cache_dir, damage):
  built = _compile()
  (entry,) = cache_dir.glob("*.npz")
  if damage == "truncated":
    entry.write_bytes(entry.read_bytes()[:300])
  elif damage == "not npz":
    entry.write_bytes(b"\x80\x04 a pickle, say")
  else:
    with np.load(entry) as f:
      arrays = dict(f)
    arrays["next_state"] = arrays["next_state"] + 1000
    with open(entry, "wb") as f:
      np.savez(f, **arrays)
  assert disk_cache.load(entry.stem) is None
  tables.clear_cache()
  _same(_compile(), built)
  assert disk_cache.load(entry.stem) is not None  # rewritten whole


def test_other_code_or_limits_miss(cache_dir, monkeypatch):
  _compile()
  (entry,) = cache_dir.glob("*.npz")
  key = entry.stem
  vocab = tables.cached_vocab(cw.ByteVocabulary(), [2], 320)
  assert disk_cache.key("regex", REGEX, vocab.key, (2,), 320, 256.0) == key
  assert disk_cache.key("regex", REGEX, "other", (2,), 320, 256.0) != key
  assert disk_cache.key("regex", REGEX, vocab.key, (2, 3), 320, 256.0) != key
  assert disk_cache.key("regex", REGEX, vocab.key, (2,), 320, 128.0) != key
  monkeypatch.setattr(disk_cache, "_code_version", lambda: "next release")
  assert disk_cache.key("regex", REGEX, vocab.key, (2,), 320, 256.0) != key


def test_off_and_pruning(cache_dir, monkeypatch):
  with disk_cache.off():
    _compile()
  assert not list(cache_dir.glob("*"))
  monkeypatch.setenv("CHUNKWISE_CONSTRAINT_CACHE", "off")
  tables.clear_cache()
  _compile()
  assert not list(cache_dir.glob("*"))
  monkeypatch.setenv("CHUNKWISE_CONSTRAINT_CACHE", str(cache_dir))
  tables.clear_cache()
  _compile()
  (first,) = cache_dir.glob("*.npz")
  os.utime(first, (1, 1))  # oldest
  monkeypatch.setattr(disk_cache, "MAX_BYTES", first.stat().st_size + 1)
  C.Regex("[xyz]+").compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
  (left,) = cache_dir.glob("*.npz")
  assert left != first
  assert not list(cache_dir.glob("*.partial"))


def test_an_unwritable_directory_means_no_cache(tmp_path, monkeypatch):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  monkeypatch.setenv("CHUNKWISE_CONSTRAINT_CACHE", str(blocker / "sub"))
  tables.clear_cache()
  assert _compile().states > 0
  tables.clear_cache()


def test_a_narrowed_schema_is_narrowed_at_once_in_another_process(
  cache_dir, monkeypatch
):
  """A schema that ran past its limits once is compiled at its narrowing
  level in the next process straight away (the level from disk): one
  try, not the full one first (which would run past its limit again:
  30 s for a schema that times out), and no worker run."""
  monkeypatch.setattr(C.constraint, "TABLES", "lazy")
  monkeypatch.setattr(C.narrowing, "_levels", {})
  props = {f"field_{i}": {"type": "string", "maxLength": 12} for i in range(16)}
  schema = {"type": "object", "properties": props}
  limits = {"max_table_mb": 0.06 * 25.6}
  c = C.JsonSchema(schema, **limits)
  c.compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
  assert c.narrowed  # it had to
  script = textwrap.dedent(f"""
    import chunkwise as cw
    from chunkwise import constraints as C
    from chunkwise.constraints import lazy, worker
    runs, tries = [], []
    real_run, real_compile = worker.run, lazy.compile
    worker.run = lambda *a, **k: runs.append(1) or real_run(*a, **k)
    lazy.compile = lambda *a, **k: tries.append(1) or real_compile(*a, **k)
    c = C.JsonSchema({schema!r}, **{limits!r})
    c.compile(cw.ByteVocabulary(), stop_ids=[2], width=320)
    print(len(runs), len(tries), len(c.narrowed))
  """)
  got = _another_process(script, cache_dir)
  assert got == ["0", "1", str(len(c.narrowed))]
