"""Tool calls read back from an answer in a model's format (`tools`,
`tool_formats`), whole or as they stream:

  calls = read_calls(text, fmt)     # [ToolCall(id, name, arguments)]
  deltas = Deltas(mode, fmt)        # per stream
  for d in deltas(text_so_far, final): send({"delta": d, ...})

The constraint made the answer exactly the format's calls, e.g. Hermes'

  <tool_call>
  {"name": ..., "arguments": ...}
  </tool_call>

so reading it is finding each call's JSON value with a JSON decoder (a
string argument may itself contain "</tool_call>"), and each arguments
value is kept as the exact text generated: a stream's fragments join to
it byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string

from chunkwise.serving.tool_formats import Format

_ALNUM = string.ascii_letters + string.digits


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A call read back: its id, name and arguments (the generated JSON
  text, as the wire carries it)."""

  id: str
  name: str
  arguments: str

  def wire(self, index: int | None = None) -> dict:
    out = {
      "id": self.id,
      "type": "function",
      "function": {"name": self.name, "arguments": self.arguments},
    }
    return out if index is None else {"index": index, **out}


def new_call_id() -> str:
  """ "call_" and 24 random letters and digits, as OpenAI's ids."""
  return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def read_calls(text: str, fmt: Format) -> list[ToolCall]:
  """The calls of an answer in `fmt` (the constraint made it one: the
  start, each call's head, arguments and tail, joined by the separator,
  the end), each arguments value as the exact text generated. ValueError
  if `text` is not that."""
  decoder = json.JSONDecoder()
  if not text.startswith(fmt.start):
    raise ValueError(f"no start of calls in {text[:200]!r}")
  calls, at, block = [], len(fmt.start), fmt.block
  while True:
    m = block.match(text, at)
    if m is None:
      raise ValueError(f"no call at {at} in {text[:200]!r}")
    _, end = decoder.raw_decode(text, m.end())
    if not text.startswith(fmt.tail, end):
      raise ValueError(f"no end of a call at {end} in {text[:200]!r}")
    calls.append(ToolCall(new_call_id(), m.group(1), text[m.end() : end]))
    at = end + len(fmt.tail)
    if text[at:] == fmt.end:
      return calls
    if not fmt.sep or not text.startswith(fmt.sep, at):
      raise ValueError(f"no separator at {at} in {text[:200]!r}")
    at += len(fmt.sep)


class Deltas:
  """A streamed answer's deltas, as the `openai` client accumulates them:
  text as `content`; each call's `index`, `id`, `type` and name once,
  then its arguments in fragments as they are generated (they join to
  `read_calls`' arguments, byte for byte). In `auto` an answer that may
  still become a call (a start of the format's marker, "<tool_ca") is
  held back until it is one or is not."""

  def __init__(self, mode: str, fmt: Format):
    """`mode`: the request's `tools.Plan.mode`; `fmt`: its format."""
    self.fmt = fmt
    self.calls = mode not in ("none", "auto")
    self.decided = mode != "auto"
    self.sent = 0  # characters of text handled
    self.index = -1  # the call being streamed
    self.ids: list[str] = []
    self._scan: _Scan | None = None

  def __call__(self, text: str, final: bool) -> list[dict]:
    """The deltas for `text` (the answer so far; `final`: all of it)."""
    marker = self.fmt.marker
    if not self.decided:
      if text.startswith(marker):
        self.decided = self.calls = True
      elif final or not marker.startswith(text[: len(marker)]):
        self.decided = True
      else:
        return []
    if not self.calls:
      out, self.sent = text[self.sent :], len(text)
      return [{"content": out}] if out else []
    return self._calls(text)

  def _calls(self, text: str) -> list[dict]:
    out = []
    while True:
      if self._scan is None:  # before a call's arguments
        m = self.fmt.block.search(text, self.sent)
        if m is None:
          return out
        self.index += 1
        call_id = new_call_id()
        self.ids.append(call_id)
        out.append(
          {
            "tool_calls": [
              {
                "index": self.index,
                "id": call_id,
                "type": "function",
                "function": {"name": m.group(1), "arguments": ""},
              }
            ]
          }
        )
        self._scan, self.sent = _Scan(), m.end()
      upto = self._scan.feed(text, self.sent)
      if upto > self.sent:
        fragment = {"index": self.index, "function": {"arguments": ""}}
        fragment["function"]["arguments"] = text[self.sent : upto]
        out.append({"tool_calls": [fragment]})
        self.sent = upto
      if not self._scan.done:
        return out
      self._scan = None


class _Scan:
  """Where a JSON value that starts at a given index ends, fed text as it
  grows: strings, escapes and nesting tracked."""

  def __init__(self):
    self.depth, self.string, self.escape = 0, False, False
    self.started = self.done = False

  def feed(self, text: str, at: int) -> int:
    """Scans text[at:]; returns the index past what belongs to the value."""
    i = at
    while i < len(text) and not self.done:
      c = text[i]
      if self.string:
        if self.escape:
          self.escape = False
        elif c == "\\":
          self.escape = True
        elif c == '"':
          self.string = False
      elif c == '"':
        self.string = True
      elif c in "{[":
        self.depth += 1
      elif c in "}]":
        self.depth -= 1
      self.started = True
      i += 1
      if self.depth == 0 and not self.string and c in '}]"':
        self.done = True
    return i
