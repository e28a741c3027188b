"""How a model writes tool calls: the format its chat template asks for,
from a small table, or the Hermes fallback for templates without tools.

  fmt = tool_formats.of(vocab)      # from the template's text
  fmt.native                        # the template renders `tools` itself
  fmt.head("get_weather")           # a call's fixed text up to its arguments

Each format is fixed text around each call's JSON object, the object's
keys in one order with one spacing (the constraint writes them so):

  hermes       (Qwen2.5/3, Hermes 2 Pro; and the fallback)
               <tool_call>
               {"name": "f", "arguments": {...}}
               </tool_call>            several: blocks joined by "\\n"
  llama3_json  (Llama 3.1-3.3)  {"name": "f", "parameters": {...}}
               one call: the template refuses several
  mistral      (Mistral v0.3, Nemo)
               [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
               past calls' ids cut to the 9 letters and digits it wants

A template is read as one of them by the text it holds (`of`). A native
format whose marker the vocabulary cannot write as text (a control token
such as some files' [TOOL_CALLS], which the constraint cannot emit) falls
back to Hermes blocks described in the system turn.
"""

from __future__ import annotations

import dataclasses
import functools
import re

# A function name, as OpenAI allows it.
NAME_CHARS = "[A-Za-z0-9_-]"


@dataclasses.dataclass(frozen=True)
class Format:
  """The fixed text of a model's tool calls."""

  name: str
  native: bool  # the chat template renders `tools` and past calls
  marker: str  # what every answer with calls starts with; never in text
  start: str  # before the first call
  open: str  # before each call's object
  key: str  # the arguments' key: "arguments" or "parameters"
  close: str  # after each call's object (after its closing "}")
  sep: str  # between calls
  end: str  # after the last call
  parallel: bool = True  # whether the template renders several calls
  id_chars: int | None = None  # the length of the ids its template wants

  def __post_init__(self):
    if not (self.start + self.open + '{"name": "').startswith(self.marker):
      raise ValueError(f"{self.name}: calls do not start with the marker")

  def head(self, name: str) -> str:
    """A call's text from its open up to its arguments value."""
    return f'{self.open}{{"name": "{name}", "{self.key}": '

  @property
  def tail(self) -> str:
    """A call's text after its arguments value."""
    return "}" + self.close

  @functools.cached_property
  def block(self) -> re.Pattern:
    """A call's head, the name as group 1 (compiled once per format: a
    stream searches with it at every token)."""
    return re.compile(
      re.escape(self.open + '{"name": "')
      + f"({NAME_CHARS}+)"
      + re.escape(f'", "{self.key}": ')
    )

  def instructions(self) -> str:
    """How a call is written, for the fallback's system text."""
    example = f"{self.head('function_name')}{{...}}{self.tail}"
    return f"{self.start}{example}{self.end}"

  def call_id(self, call_id: str) -> str:
    """A past call's id as the template wants it."""
    if self.id_chars is None:
      return call_id
    alnum = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return alnum[-self.id_chars :].rjust(self.id_chars, "0")


HERMES = Format(
  "hermes",
  native=True,
  marker="<tool_call>",
  start="",
  open="<tool_call>\n",
  key="arguments",
  close="\n</tool_call>",
  sep="\n",
  end="",
)
FALLBACK = dataclasses.replace(HERMES, native=False)
LLAMA3_JSON = Format(
  "llama3_json",
  native=True,
  marker='{"name": "',
  start="",
  open="",
  key="parameters",
  close="",
  sep="",
  end="",
  parallel=False,
)
MISTRAL = Format(
  "mistral",
  native=True,
  marker="[TOOL_CALLS]",
  start="[TOOL_CALLS][",
  open="",
  key="arguments",
  close="",
  sep=", ",
  end="]",
  id_chars=9,
)
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)

# What each format's templates hold (read in this order).
_SIGNS = (
  (MISTRAL, ("[TOOL_CALLS]",)),
  (HERMES, ("<tool_call>", "tools")),
  (LLAMA3_JSON, ('"parameters": dictionary of argument name',)),
)


def from_template(text: str | None) -> Format:
  """The format a chat template's text asks for; FALLBACK if none."""
  for fmt, signs in _SIGNS:
    if text and all(s in text for s in signs):
      return fmt
  return FALLBACK


def of(vocab) -> Format:
  """The format of `vocab`'s chat template (`from_template`), FALLBACK
  where its marker is a control token the constraint cannot write."""
  fmt = from_template(getattr(vocab, "chat_template", None))
  if fmt.native and not writable(vocab, fmt.marker):
    return FALLBACK
  return fmt


def writable(vocab, text: str) -> bool:
  """Whether `text` encodes to tokens that have text (no control tokens)."""
  spelled = vocab.token_bytes()
  return all(spelled[i] is not None for i in vocab.encode(text))
