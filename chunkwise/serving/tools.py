"""OpenAI tool calling: a request's tools, the one language its answer may
take, the tools' text in the prompt, and the calls read back.

  plan = tools.parse(body.tools, body.tool_choice, body.parallel_tool_calls)
  plan = plan.written(tool_formats.of(vocab))   # the template's format
  constraint = plan.constraint(answer)   # answer: response_format's or None
  messages = plan.messages(messages)     # past calls and results
  specs = plan.specs()                   # `tools` for a native template
  content, calls = plan.read(text)       # the calls (`tool_calls`)

Calls take the format the model's chat template asks for (`tool_formats`:
Hermes blocks, Llama 3's JSON, Mistral's [TOOL_CALLS]); the template then
renders the tools and past calls itself. A template that does not render
tools (SmolLM2's ChatML among them) gets the fallback: the tools described
in the system turn, calls in the Hermes form, past calls as their blocks:

  <tool_call>
  {"name": "get_weather", "arguments": {"city": "Paris"}}
  </tool_call>

Each mode is one regular language, enforced by the constraint automaton
while decoding (never parsed after the fact):

  none      text without the format's marker, "<tool_call>" (or the
            response_format's JSON)
  named     exactly one call of that function
  required  one call, or several with parallel_tool_calls (the default)
  auto      the text of `none`, or the calls of `required`

A call's object is {"name": <one of the tools>, "arguments": <that tool's
parameters schema>}, compiled by the JSON-schema path, so every call is
valid JSON valid against its schema, sampled or greedy, whatever the
model. `read` finds each call's JSON value with a JSON decoder (a string
argument may itself contain "</tool_call>"), and keeps each arguments
value as the exact text generated, which streams send in pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from typing import Any

from chunkwise import constraints
from chunkwise.serving import tool_formats
from chunkwise.serving.api import ApiError, digit_bounded
from chunkwise.serving.tool_calls import ToolCall, read_calls
from chunkwise.serving.tool_formats import Format

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MODES = ("none", "auto", "required")


def _bad(message: str) -> ApiError:
  return ApiError(400, message)


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str
  description: str
  parameters: dict  # a JSON schema (an object)
  strict: bool


def _tool(i: int, raw: Any) -> Tool:
  where = f"tools[{i}]"
  if not isinstance(raw, dict) or raw.get("type") != "function":
    kind = raw.get("type") if isinstance(raw, dict) else raw
    raise _bad(f"{where}.type must be 'function', got {kind!r:.60}")
  f = raw.get("function")
  if not isinstance(f, dict):
    raise _bad(f"{where}.function must be an object")
  name = f.get("name")
  if not isinstance(name, str) or not NAME.fullmatch(name):
    raise _bad(
      f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, '_' and "
      f"'-', got {name!r:.80}"
    )
  params = f.get("parameters", {"type": "object", "properties": {}})
  if not isinstance(params, dict) or params.get("type", "object") != "object":
    raise _bad(
      f"{where}.function.parameters must be a JSON schema of an object, "
      f"got {params!r:.80}"
    )
  params = {"type": "object", **params}  # arguments are an object
  description = f.get("description") or ""
  if not isinstance(description, str):
    raise _bad(f"{where}.function.description must be a string")
  return Tool(name, description, params, bool(f.get("strict")))


@dataclasses.dataclass(frozen=True)
class Plan:
  """A request's tools and the language its answer may take."""

  tools: tuple[Tool, ...]
  mode: str  # "none", "auto", "required" or "named"
  allowed: tuple[str, ...]  # the tools the answer may call
  parallel: bool
  fmt: Format = tool_formats.FALLBACK  # how the model writes calls

  @property
  def named(self) -> str | None:
    return self.allowed[0] if self.mode == "named" else None

  def written(self, fmt: Format) -> Plan:
    """This plan with calls written in `fmt` (the model's format)."""
    return dataclasses.replace(self, fmt=fmt)

  # -- the language ----------------------------------------------------

  def _arguments(self, tool: Tool) -> constraints.JsonSchema:
    """A tool's arguments' constraint, from its own schema (its `$ref`s
    resolve in it): `strict` ones as given, every keyword enforced in
    full (else a 400 naming the one that cannot be); others with the
    server's digit bounds. Its regex is built here, so a schema that
    cannot be is a 400 now."""
    schema = tool.parameters if tool.strict else digit_bounded(tool.parameters)
    try:
      out = constraints.JsonSchema(schema, strict=tool.strict)
      out.regex()
    except ValueError as e:
      raise _bad(f"tool {tool.name!r}: parameters: {e}") from None
    return out

  def calls_regex(self) -> str:
    """Calls in the format, as one regex (`constraint` compiles each
    tool's arguments alone, in `_calls`' holes)."""
    by_name = {t.name: t for t in self.tools}
    return self._calls(lambda name: self._arguments(by_name[name]).regex())

  def _calls(self, arguments) -> str:
    """Calls in the format: each its fixed head (open, name, key), its
    tool's `arguments(name)` (a regex) and its fixed tail; several with
    `parallel` (not for a named choice, nor where the template takes one
    call only)."""
    f = self.fmt
    frames = "|".join(
      f"{literal(f.head(name))}({arguments(name)})" for name in self.allowed
    )
    one = f"({frames}){literal(f.tail)}"
    if self.parallel and self.mode != "named" and f.parallel:
      one = f"{one}({literal(f.sep)}{one})*"
    return f"{literal(f.start)}{one}{literal(f.end)}"

  def constraint(self, answer=None):
    """The constraint of the whole answer (`answer`: response_format's
    JSON schema for the text, or None for free text). A 400 names what
    cannot be compiled."""
    if answer is not None and not isinstance(answer, constraints.JsonSchema):
      raise _bad(
        "with tools, the answer's text can follow a JSON schema "
        "(response_format) but not a regex or a choice"
      )
    hole = constraints.Framed.hole
    try:
      marker = self.fmt.marker
      text = answer.regex() if answer is not None else without(marker)
      if self.mode == "none":
        return constraints.Regex(text)
      # Each tool's arguments compiled alone, in a hole of the frame.
      by_name = {t.name: t for t in self.tools}
      parts = {
        f"a{i}": self._arguments(by_name[n]) for i, n in enumerate(self.allowed)
      }
      index = {n: f"a{i}" for i, n in enumerate(self.allowed)}
      calls = self._calls(lambda name: hole(index[name]))
      if self.mode == "auto":
        if answer is not None:
          parts["answer"] = answer
          text = hole("answer")
        return constraints.Framed(f"({text})|({calls})", parts)
      return constraints.Framed(calls, parts)
    except ValueError as e:
      raise _bad(f"tools: {e}") from None

  # -- the prompt ------------------------------------------------------

  def specs(self) -> list[dict]:
    """The tools as chat templates take them (`tools=`)."""
    return [
      {
        "type": "function",
        "function": {
          "name": t.name,
          "description": t.description,
          "parameters": t.parameters,
        },
      }
      for t in self.tools
    ]

  def system_text(self) -> str:
    """The tools, described for a model whose template has no tools."""
    specs = "\n".join(json.dumps(s) for s in self.specs())
    return (
      "You can call these functions (JSON schemas of their arguments):\n"
      f"<tools>\n{specs}\n</tools>\n"
      "To call one, answer with its name and arguments as a JSON object "
      "in tags, one block per call:\n" + self.fmt.instructions()
    )

  def messages(self, messages: list[dict]) -> list[dict]:
    """`messages` for the template: for a native format past calls with
    their arguments as objects (`native_turn`; the tools go as `specs`);
    for the fallback the tools in the system turn, past calls as their
    blocks, results as `tool` turns (`render_turn`)."""
    if self.fmt.native:
      return [native_turn(m, self.fmt) for m in messages]
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
      first = out[0].get("content") or ""
      out[0]["content"] = f"{first}\n\n{self.system_text()}".lstrip()
    else:
      out.insert(0, {"role": "system", "content": self.system_text()})
    return [render_turn(m) for m in out]

  # -- reading the answer -----------------------------------------------

  def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer: the calls when it made
    them (content None), else its text."""
    if self.mode == "none" or not text.startswith(self.fmt.marker):
      return text, []
    try:
      return None, read_calls(text, self.fmt)
    except ValueError:  # not the calls' language (the constraint's is)
      return text, []


def literal(text: str) -> str:
  """`text` as a regex of itself, escaping only the metacharacters (the
  constraint's regex engine refuses escapes of letters and spaces); a
  newline as "\\n"."""
  escaped = re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)
  return escaped.replace("\n", "\\n")


def without(word: str) -> str:
  """A regex of the texts in which `word` never occurs and that do not end
  in a start of it ("<tool_cal"): `word`'s first character must not occur
  again in it, as in "<tool_call>". Each '<' starts either a run of
  partial matches, each cut by the next '<', or a partial match broken by
  a character that is neither the next one of `word` nor '<'."""
  first, rest = word[0], word[1:]
  if first in rest:
    raise ValueError(f"{word!r} repeats its first character")
  f = re.escape(first)
  partial = "|".join(re.escape(rest[:j]) for j in range(1, len(rest)))
  broken = "|".join(
    f"{re.escape(rest[:j])}[^{f}{re.escape(rest[j])}]" for j in range(len(rest))
  )
  return f"([^{f}]|({f}({partial})?)*{f}({broken}))*"


def _arguments_object(call: Any) -> tuple[str, Any]:
  """A past call's (name, arguments), the arguments as an object where
  they are a JSON string (templates expect objects)."""
  f = call.get("function") if isinstance(call, dict) else None
  if not isinstance(f, dict):
    raise ValueError(f"a tool call {call!r:.80} has no function object")
  args = f.get("arguments") or "{}"
  if isinstance(args, str):
    with contextlib.suppress(json.JSONDecodeError):
      args = json.loads(args)
  return f.get("name"), args


def render_turn(m: dict) -> dict:
  """For the fallback: an assistant turn's tool calls as the blocks the
  model writes, a tool result as its text (content None: empty)."""
  fmt = tool_formats.FALLBACK
  content = m.get("content") or ""
  if m.get("role") == "assistant" and m.get("tool_calls"):
    blocks = []
    for c in m["tool_calls"]:
      name, args = _arguments_object(c)
      body = json.dumps({"name": name, "arguments": args})
      blocks.append(f"{fmt.open}{body}{fmt.close}")
    content = "\n".join([content, *blocks]).lstrip("\n")
  out = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
  out["content"] = content
  return out


def native_turn(m: dict, fmt: Format) -> dict:
  """For a template that renders tools: past calls with their arguments
  as objects and ids as `fmt` wants them (Mistral's 9 characters), the
  results' `tool_call_id` likewise, content None as empty."""
  out = {**m, "content": m.get("content") or ""}
  if m.get("role") == "assistant" and m.get("tool_calls"):
    calls = []
    for c in m["tool_calls"]:
      name, args = _arguments_object(c)
      calls.append(
        {
          "id": fmt.call_id(str(c.get("id") or "")),
          "type": "function",
          "function": {"name": name, "arguments": args},
        }
      )
    out["tool_calls"] = calls
  if m.get("role") == "tool" and m.get("tool_call_id") is not None:
    out["tool_call_id"] = fmt.call_id(str(m["tool_call_id"]))
  return out


def parse(tools: Any, tool_choice: Any, parallel: Any) -> Plan | None:
  """The request's tools and choice checked (400s name the bad field);
  None without tools."""
  if not tools:
    if tool_choice not in (None, "none"):
      raise _bad(f"tool_choice={tool_choice!r:.60} needs tools")
    if parallel is not None:
      raise _bad("parallel_tool_calls needs tools")
    return None
  if not isinstance(tools, list):
    raise _bad(f"tools must be a list, got {type(tools).__name__}")
  defined = tuple(_tool(i, t) for i, t in enumerate(tools))
  names = [t.name for t in defined]
  if len(set(names)) != len(names):
    raise _bad(f"tools define a name twice: {names}")
  if parallel is not None and not isinstance(parallel, bool):
    raise _bad(f"parallel_tool_calls must be true or false, got {parallel!r}")
  mode, allowed = _choice(tool_choice, names)
  return Plan(defined, mode, allowed, parallel is not False)


def _choice(choice: Any, names: list[str]) -> tuple[str, tuple[str, ...]]:
  if choice is None:
    return "auto", tuple(names)
  if isinstance(choice, str):
    if choice in MODES:
      return choice, tuple(names)
    if choice in names:  # TGI's form: a tool's name alone
      return "named", (choice,)
    raise _bad(
      f"tool_choice must be one of {', '.join(MODES)}, a function or a "
      f"tool's name, got {choice!r:.60}"
    )
  if not isinstance(choice, dict):
    raise _bad(f"tool_choice must be a string or an object, got {choice!r:.60}")
  if choice.get("type") == "function":
    f = choice.get("function")
    name = f.get("name") if isinstance(f, dict) else None
    if name not in names:
      raise _bad(
        f"tool_choice names function {name!r:.80}, which is not in tools "
        f"({', '.join(names)})"
      )
    return "named", (name,)
  if choice.get("type") == "allowed_tools":
    spec = choice.get("allowed_tools")
    if not isinstance(spec, dict):
      raise _bad(
        f"tool_choice.allowed_tools must be an object, got {spec!r:.60}"
      )
    mode = spec.get("mode", "auto")
    if mode not in ("auto", "required"):
      raise _bad(
        "tool_choice.allowed_tools.mode must be auto or required, got "
        f"{mode!r:.60}"
      )
    picked = []
    listed = spec.get("tools") or []
    if not isinstance(listed, list):
      raise _bad("tool_choice.allowed_tools.tools must be a list")
    for k, t in enumerate(listed):
      f = t.get("function") if isinstance(t, dict) else None
      name = f.get("name") if isinstance(f, dict) else None
      if name not in names:
        raise _bad(
          f"tool_choice.allowed_tools.tools[{k}] names {name!r:.80}, which "
          f"is not in tools ({', '.join(names)})"
        )
      picked.append(name)
    if not picked:
      raise _bad("tool_choice.allowed_tools.tools must name a tool")
    return mode, tuple(picked)
  raise _bad(
    "tool_choice.type must be 'function' or 'allowed_tools', got "
    f"{choice.get('type')!r:.60}"
  )
