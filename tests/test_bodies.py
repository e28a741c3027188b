"""Request bodies (`chunkwise.serving.bodies`): bounded before they are
parsed, checked level by level, with the cyclic collector paused."""

import gc
import json
import random
import re
import threading

import pytest

from chunkwise.serving import bodies
from chunkwise.serving.api import ApiError


def _plain_depth(v) -> int:  # the recursive definition
  if isinstance(v, dict):
    return 1 + max(map(_plain_depth, v.values()), default=0)
  if isinstance(v, list):
    return 1 + max(map(_plain_depth, v), default=0)
  return 0


def _random_value(rng, depth):
  kind = rng.randrange(4 if depth < 6 else 2)
  if kind == 0:
    return rng.randrange(10)
  if kind == 1:
    return "s"
  items = [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
  return items if kind == 2 else {str(i): x for i, x in enumerate(items)}


def test_depth_is_the_recursive_definition():
  rng = random.Random(0)
  for _ in range(500):
    v = _random_value(rng, 0)
    assert bodies.depth(v) == _plain_depth(v), v


def _count(v) -> int:
  if isinstance(v, dict):
    return 1 + sum(map(_count, v.values()))
  if isinstance(v, list):
    return 1 + sum(map(_count, v))
  return 0


def test_containers_are_counted_outside_strings():
  """`containers` against the arrays and objects `json.loads` makes, on
  random values whose strings hold brackets, quotes and backslash runs."""
  rng = random.Random(1)
  pieces = ["[", "{", '"', "\\", "a", "]", "}"]
  for _ in range(500):
    v = _random_value(rng, 0)
    text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
    v = [v, text, {text: [text]}]
    raw = json.dumps(v, ensure_ascii=rng.random() < 0.5).encode()
    assert bodies.containers(raw) == _count(v), raw
  assert bodies.containers(b'"\\\\"[') == 1  # an escaped backslash
  assert bodies.containers(b'"\\"[') == 0  # an escaped quote: a string


def test_refusals_name_what_is_wrong():
  def refused(raw, match, **limits):
    with pytest.raises(ApiError) as e:
      bodies.parse(raw, status=422, **limits)
    assert e.value.status == 422 and re.search(match, e.value.message)

  refused(b"[" * 10 + b"]" * 10, "nests deeper than 5", max_depth=5)
  refused(b"[" * 10_000 + b"]" * 10_000, "nests deeper than 64")
  refused(b"[" * 60_000 + b"]" * 60_000, "holds 60000 JSON arrays")
  refused(b'{"a": [[], {}, "[{"]}', "holds 4 JSON arrays", max_containers=3)
  refused(b"[1]", "must be a JSON object")
  utf16 = '{"a":"\\"","x":[' + ",".join(["[]"] * 60) + "]}"
  # (as UTF-8 its NULs make it no JSON: never parsed as UTF-16, whose
  # escaped quotes the count would misread)
  refused(utf16.encode("utf-16-le"), "not valid JSON", max_containers=100)
  refused('{"a": "\\ud800"}'.encode("utf-32"), "not UTF-8")
  refused(b'{"a": "\xff"}', "not UTF-8 \\(byte 7\\)")
  refused(b"null", "must be a JSON object")
  refused(b'{"a": 1', "not valid JSON")
  refused(b'{"a": "\\ud800"}', "unpaired surrogate")
  assert bodies.parse(b'{"a": [[], {}]}', status=400, max_containers=4) == {
    "a": [[], {}]
  }


def test_the_collector_is_paused_while_any_parse_runs_and_only_then():
  assert gc.isenabled()
  inside, release = threading.Event(), threading.Event()

  def hold():
    with bodies._collector_paused():
      inside.set()
      release.wait(10)

  t = threading.Thread(target=hold)
  t.start()
  inside.wait(10)
  with bodies._collector_paused():
    assert not gc.isenabled()
  assert not gc.isenabled()  # the other parse still runs
  release.set()
  t.join()
  assert gc.isenabled()
  gc.disable()  # off before: stays off
  try:
    bodies.parse(json.dumps({"a": [1]}).encode(), status=400)
    assert not gc.isenabled()
  finally:
    gc.enable()
