"""Chat templates of model files, rendered in a sandbox.

A checkpoint's chat template is a Jinja program written by whoever made
the file, so it is untrusted code. It renders here, as in transformers,
in Jinja's `ImmutableSandboxedEnvironment`, which refuses attributes that
start with `_` (`__class__`, `__globals__`, ...), unsafe callables and
in-place changes of lists and dicts; with transformers' helpers that
templates call (`raise_exception`, `strftime_now`, a `tojson` filter with
`ensure_ascii=False`, `indent`, `separators`, `sort_keys`; `dict`,
`namespace` that refuses `_` names) and the `{% generation %}` block:

  template = ChatTemplate(text, source="model.gguf: tokenizer.chat_template")
  template.render([{"role": "user", "content": "Hi"}],
                  add_generation_prompt=True, bos_token="<s>")

What the template sees is plain data: messages, tools and extra variables
are copied into JSON types (str, int, float, bool, None, lists, dicts), so
no method of a caller's object is reachable. Resources are bounded too:
the rendered text may hold at most `max(MAX_OUTPUT_CHARS, 4 x the input's
characters)` characters, `*`, `**`, `%`, `+`, `~`, `str.format` and
filters may not build values larger than that, ranges hold at most
100,000 items (Jinja's own cap), and rendering stops after `TIME_LIMIT_S`
(checked at every attribute, item, call, filter, operator and loop
iteration: an empty loop cannot spin past it). Each render has its own
time and size limits, however many run at once.

Every failure is a `ChatTemplateError` (a `ValueError`) naming the
template's source: a syntax error, a sandbox violation ("nothing was
run"), a `raise_exception(message)` of the template (the message is
kept), an undefined name, or a limit.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

# The rendered text may hold max(MAX_OUTPUT_CHARS, 4 x input chars).
MAX_OUTPUT_CHARS = 1 << 20
# Rendering stops after this many seconds.
TIME_LIMIT_S = 10.0
# Largest integer power a template may compute (in bits).
_MAX_POWER_BITS = 4096
# Widths and precisions inside `%` and `str.format` specs, e.g. "%20s".
_SPEC_NUMBER = re.compile(r"\d+")


class ChatTemplateError(ValueError):
  """A chat template that does not parse, breaks the sandbox, raises, or
  runs past a limit; the message names the template's source."""


def plain(value: Any, *, _depth: int = 0) -> Any:
  """`value` rebuilt from JSON types only (str, int, float, bool, None,
  list, dict with string keys); anything else becomes "<TypeName>", so a
  template can reach no method of the caller's objects."""
  if _depth > 64:
    raise ValueError("chat messages are nested more than 64 levels deep")
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {
      plain(k, _depth=_depth + 1): plain(v, _depth=_depth + 1)
      for k, v in value.items()
    }
  if isinstance(value, list | tuple):
    return [plain(v, _depth=_depth + 1) for v in value]
  item = getattr(value, "item", None)  # numpy scalars
  if callable(item) and getattr(value, "shape", None) == ():
    return plain(item(), _depth=_depth + 1)
  return f"<{type(value).__name__}>"


def _chars(value: Any) -> int:
  """Characters of the text inside plain data (an input-size measure)."""
  if isinstance(value, str):
    return len(value)
  if isinstance(value, dict):
    return sum(_chars(k) + _chars(v) for k, v in value.items())
  if isinstance(value, list):
    return sum(_chars(v) for v in value)
  return 8


@functools.cache
def _environment_class():
  """A factory of sandboxes (built once: jinja2 is imported lazily)."""
  import jinja2
  from jinja2 import nodes
  from jinja2.ext import Extension
  from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
  from jinja2.visitor import NodeTransformer

  class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the
    assistant's tokens with it): renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (Jinja reads a class attribute)

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(
        self.call_method("_body"), [], [], body
      ).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class _Guard(NodeTransformer):
    """`Sandbox._parse`'s rewrite of a template's tree."""

    def visit_Concat(self, node):
      node = self.generic_visit(node)
      return nodes.Call(
        nodes.Name("cw_concat", "load"), node.nodes, [], None, None
      ).set_lineno(node.lineno)

    def visit_For(self, node):
      node = self.generic_visit(node)
      node.iter = nodes.Call(
        nodes.Name("cw_loop", "load"), [node.iter], [], None, None
      ).set_lineno(node.lineno)
      return node

  class Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a time budget and size checks on every
    operator, call and filter that can build a large value."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self):
      super().__init__(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"],
      )
      # Each render's own limits: renders of one template run in many
      # threads at once, and one ending must not lift another's.
      self._limits = threading.local()

    @property
    def deadline(self) -> float:
      return getattr(self._limits, "deadline", math.inf)

    @deadline.setter
    def deadline(self, value: float) -> None:
      self._limits.deadline = value

    @property
    def max_chars(self) -> int:
      return getattr(self._limits, "max_chars", MAX_OUTPUT_CHARS)

    @max_chars.setter
    def max_chars(self, value: int) -> None:
      self._limits.max_chars = value

    def _parse(self, source, name, filename):
      """The template's tree with every `~` a checked call (`cw_concat`)
      and every loop's items counted against the time budget
      (`cw_loop`): neither can then build past the size limit, or spin
      past the time limit without calling anything."""
      return _Guard().visit(super()._parse(source, name, filename))

    def concat(self, *parts) -> str:
      self.tick()
      out = "".join(map(str, parts))
      self.check_size(len(out), "'~'")
      return out

    def loop(self, items):
      for item in items:
        self.tick()
        yield item

    def tick(self) -> None:
      if time.monotonic() > self.deadline:
        raise SecurityError(
          f"rendering took longer than {TIME_LIMIT_S:g} s (TIME_LIMIT_S)"
        )

    def check_size(self, n: int, what: str) -> None:
      if n > self.max_chars:
        raise SecurityError(
          f"{what} would build {n} items, over the limit of {self.max_chars}"
        )

    def check_args(self, args, kwargs, what: str) -> None:
      for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
          self.check_size(abs(a), what)

    def check_spec(self, text: str, what: str) -> None:
      for number in _SPEC_NUMBER.findall(text):
        if len(number) > 7 or int(number) > self.max_chars:
          raise SecurityError(
            f"{what} asks for a width of {number}, over the limit of "
            f"{self.max_chars}"
          )

    def getattr(self, obj, attribute):
      self.tick()
      return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
      self.tick()
      return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):
      __self.tick()
      __self.check_args(args, kwargs, f"calling {__obj!r}")
      return super().call(__context, __obj, *args, **kwargs)

    def checked_filter(self, name: str, f):
      """`f` with the time budget and its size arguments checked
      (compiled templates call filters directly, not `call_filter`)."""
      skip = 2 if getattr(f, "jinja_pass_arg", None) else 1  # ctx, value

      @functools.wraps(f)  # keeps jinja_pass_arg
      def wrapper(*args, **kwargs):
        self.tick()
        self.check_args(args[skip:], kwargs, f"the filter {name!r}")
        if name == "format" and isinstance(args[skip - 1], str):
          self.check_spec(args[skip - 1], "the format filter")
        return f(*args, **kwargs)

      return wrapper

    def wrap_str_format(self, value):
      wrapped = super().wrap_str_format(value)
      if wrapped is None:
        return None
      self.check_spec(value.__self__, "str.format")
      return wrapped

    def call_binop(self, context, operator, left, right):
      self.tick()
      if operator == "*":
        for seq, n in ((left, right), (right, left)):
          if isinstance(seq, str | list | tuple) and isinstance(n, int):
            self.check_size(len(seq) * max(n, 0), "'*'")
        return left * right
      if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0:
          bits = abs(left).bit_length() * right
          if abs(left) > 1 and bits > _MAX_POWER_BITS:
            raise SecurityError(
              f"{left} ** {right} has about {bits} bits, over the limit "
              f"of {_MAX_POWER_BITS}"
            )
        return left**right
      if operator == "+":
        if isinstance(left, str | list | tuple) and isinstance(
          right, str | list | tuple
        ):
          self.check_size(len(left) + len(right), "'+'")
        return left + right
      if isinstance(left, str):
        self.check_spec(left, "'%' formatting")
      return left % right

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  def tojson(
    x, ensure_ascii=False, indent=None, separators=None, sort_keys=False
  ):
    return json.dumps(
      x,
      ensure_ascii=ensure_ascii,
      indent=indent,
      separators=separators,
      sort_keys=sort_keys,
    )

  class SafeDict:
    """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the
    builtin type."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class SafeNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing attribute names that start with '_'."""

    def __init__(*args, **kwargs):
      self, rest = args[0], args[1:]
      attrs = dict(*rest, **kwargs)
      for name in attrs:
        SafeNamespace.check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      SafeNamespace.check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(
          f"namespace attributes may not start with '_', got {name!r}"
        )

  def make() -> Sandbox:
    env = Sandbox()
    env.filters["tojson"] = tojson
    env.filters = {n: env.checked_filter(n, f) for n, f in env.filters.items()}
    env.globals.update(
      cw_concat=env.concat,
      cw_loop=env.loop,
      raise_exception=raise_exception,
      strftime_now=strftime_now,
      dict=SafeDict(),
      namespace=SafeNamespace,
    )
    return env

  return make


class ChatTemplate:
  """A model's chat template (module docstring).

  Args:
    text: the Jinja source.
    source: where it came from, for messages, e.g.
      "model.gguf: tokenizer.chat_template".
  """

  def __init__(self, text: str, source: str = "the checkpoint"):
    if not isinstance(text, str):
      raise ChatTemplateError(
        f"chat template of {source} is {type(text).__name__}, expected a string"
      )
    self.text = text
    self.source = source
    self._compiled = None
    self._env = None

  def _error(self, what: str) -> ChatTemplateError:
    return ChatTemplateError(f"chat template of {self.source}: {what}")

  def check(self) -> ChatTemplate:
    """Parses the template now (a ChatTemplateError if it does not);
    returns it."""
    self._template()
    return self

  def _template(self):
    if self._compiled is None:
      try:
        import jinja2
      except ImportError as e:
        raise ImportError(
          "rendering a chat template needs jinja2: pip install jinja2"
        ) from e
      env = _environment_class()()
      try:
        self._compiled = env.from_string(self.text)
      except jinja2.TemplateSyntaxError as e:
        raise self._error(
          f"syntax error at line {e.lineno}: {e.message}"
        ) from None
      self._env = env
    return self._compiled

  def render(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
  ) -> str:
    """The template's text for `messages` ([{"role", "content"}, ...]).

    `tools` (JSON schemas of functions), `documents` and `variables`
    (e.g. `bos_token`, `enable_thinking`) are passed to the template as
    transformers passes them.

    Raises:
      ChatTemplateError: see the module docstring.
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
      raise ValueError(
        f"messages must be a list of {{'role', 'content'}} dicts, got "
        f"{type(messages).__name__}"
      )
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping):
        raise ValueError(
          f"messages[{i}] is {type(m).__name__}, expected a dict with "
          "'role' and 'content'"
        )
    context = plain(
      {
        "messages": list(messages),
        "tools": None if tools is None else list(tools),
        "documents": None if documents is None else list(documents),
        "add_generation_prompt": bool(add_generation_prompt),
        **variables,
      }
    )
    template = self._template()
    env = self._env
    env.max_chars = max(MAX_OUTPUT_CHARS, 4 * _chars(context))
    env.deadline = time.monotonic() + TIME_LIMIT_S
    out, size = [], 0
    try:
      for piece in template.generate(**context):
        size += len(piece)
        if size > env.max_chars:
          raise SecurityError(
            f"the rendered text is longer than {env.max_chars} characters"
          )
        out.append(piece)
    except SecurityError as e:
      raise self._error(
        f"refused by the sandbox: {e} (nothing outside the template ran)"
      ) from None
    except TemplateError as e:
      # raise_exception(...) and undefined names land here.
      raise self._error(str(e)) from None
    except (RecursionError, MemoryError, OverflowError) as e:
      raise self._error(f"{type(e).__name__}: {e}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError) as e:
      raise self._error(f"{type(e).__name__}: {e}") from None
    finally:
      env.deadline = math.inf
    return "".join(out)

  def __repr__(self) -> str:
    return f"ChatTemplate({len(self.text)} chars from {self.source})"
