"""Reading compiled programs: where do the weights go?

DESIGN §6 asks decode and prefill to read every weight once, in place. A
compiled program breaks that rule when an instruction other than a matmul
(or a collective, which moves shards between devices by design) turns a
weight into a new buffer of comparable size: a `copy`, a slice or dynamic
slice of a stacked array, a transpose, a dequantizing `convert`.
`weight_copies` follows each weight parameter of an optimized HLO module
through the plumbing that does not touch its bytes (bitcasts, tuples,
while loops, calls) and lists every such consumer.

  text = jitted.lower(weights, ...).compile().as_text()
  assert weight_copies(text, len(jax.tree.leaves(weights))) == []

The weights must be the program's first parameters (chunkwise's programs
all take them first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import jax

# Collectives move weight shards between devices on purpose (the
# weight-gathered layout streams them); their outputs are not weights.
_COLLECTIVES = {
  "all-gather",
  "all-gather-start",
  "all-reduce",
  "all-reduce-start",
  "all-to-all",
  "collective-permute",
  "collective-permute-start",
  "reduce-scatter",
}
# Ops that read a weight in place: matmuls (XLA's, or a kernel behind a
# custom call) and row lookups (the embedding reads only its rows).
_IN_PLACE = {"dot", "convolution", "custom-call", "gather"}
# A consumer whose output has at least this share of the weight's elements
# has copied it (a slice of a stacked [layers, ...] weight is one layer).
_COPY_SHARE = 1 / 8

_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
  r"(?P<op>[a-z][a-z0-9\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
_COMP = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction, as printed."""

  name: str
  shape: str  # e.g. "f32[64,64]{1,0}" or a tuple of them
  op: str
  args: str  # the text between the parentheses
  attrs: str  # everything after them

  @property
  def operands(self) -> tuple[str, ...]:
    return tuple(re.findall(r"%([\w.\-]+)", self.args))

  @property
  def elements(self) -> int:
    """Elements of the result (of its largest array, for a tuple)."""
    return max(
      (
        math.prod(int(d) for d in dims.split(",") if d)
        for dims in _ARRAY.findall(self.shape)
      ),
      default=0,
    )

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
    return m.group(1) if m else None


@dataclasses.dataclass(frozen=True)
class Module:
  computations: dict[str, tuple[Instr, ...]]
  entry: str

  def param(self, computation: str, number: int) -> Instr | None:
    for i in self.computations[computation]:
      if i.op == "parameter" and int(i.args) == number:
        return i
    return None


def parse(text: str) -> Module:
  """The computations of an HLO module's text (`Compiled.as_text()`)."""
  comps: dict[str, list[Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      m = _COMP.match(line)
      if m:
        current = m.group("name")
        comps[current] = []
        if line.startswith("ENTRY"):
          entry = current
    elif line.strip() == "}":
      current = None
    elif m := _INSTR.match(line):
      comps[current].append(Instr(**m.groupdict()))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return Module({k: tuple(v) for k, v in comps.items()}, entry)


# (computation, instruction) -> {tuple index path: weight number}; the
# path is () for a weight itself, (2,) for element 2 of a tuple.
_Tracked = dict[tuple[str, str], dict[tuple[int, ...], int]]


def weight_copies(
  text: str, n_weights: int, *, min_elements: int = 1024
) -> list[str]:
  """Every instruction of the compiled module `text` that makes a new
  buffer out of one of its first `n_weights` parameters (those of at least
  `min_elements` elements: norm scales and biases are small and read
  inside fusions). Returns one line per offender, naming the computation,
  the instruction, its op and shape, and the weight's parameter number;
  empty when every weight is read in place."""
  module = parse(text)
  tracked: _Tracked = {}
  sizes: dict[int, int] = {}
  for number in range(n_weights):
    p = module.param(module.entry, number)
    if p is not None and p.elements >= min_elements:
      tracked[(module.entry, p.name)] = {(): number}
      sizes[number] = p.elements
  found: set[str] = set()
  work = list(tracked)
  while work:
    comp, name = work.pop()
    paths = tracked[(comp, name)]
    for user in module.computations[comp]:
      slots = [i for i, o in enumerate(user.operands) if o == name]
      if not slots:
        continue
      for target, target_paths in _forward(module, comp, user, slots, paths):
        have = tracked.setdefault(target, {})
        if not target_paths.items() <= have.items():
          have.update(target_paths)
          work.append(target)
      weight = paths.get(())
      if weight is not None and _copies(module, user, sizes[weight]):
        found.add(
          f"{comp}: %{user.name} = {user.op} {user.shape.split('{')[0]} "
          f"from weight parameter {weight}"
        )
  return sorted(found)


def _forward(module: Module, comp: str, user: Instr, slots, paths):
  """Where `user` hands the tracked value on: (target, paths) pairs."""
  if user.op == "bitcast":
    return [((comp, user.name), paths)]
  if user.op == "get-tuple-element":
    k = int(user.attr("index"))
    inner = {p[1:]: w for p, w in paths.items() if p and p[0] == k}
    return [((comp, user.name), inner)] if inner else []
  if user.op == "tuple":
    return [
      ((comp, user.name), {(s, *p): w for s in slots for p, w in paths.items()})
    ]
  if user.op == "while":
    out = [((comp, user.name), paths)]  # loop-invariant weights pass on
    for key in ("body", "condition"):
      p = module.param(user.attr(key), 0)
      out.append(((user.attr(key), p.name), paths))
    return out
  if user.op in ("call", "async-start"):
    callee = user.attr("to_apply") or user.attr("calls")
    return [
      ((callee, module.param(callee, s).name), paths)
      for s in slots
      if module.param(callee, s) is not None
    ]
  return []


def _copies(module: Module, user: Instr, weight_elements: int) -> bool:
  """Whether `user`, reading a whole weight, writes a copy of it."""
  if user.op in ("bitcast", "get-tuple-element", "tuple", "while", "call"):
    return False
  if user.op in _IN_PLACE or user.op in _COLLECTIVES:
    return False
  if user.op == "fusion":
    ops = {i.op for i in module.computations[user.attr("calls")]}
    if ops & _IN_PLACE:
      return False
  return user.elements >= weight_elements * _COPY_SHARE


class _Recorder:
  """A jitted function that remembers the abstract arguments of its
  calls, to compile them again for inspection."""

  def __init__(self, name: str, jitted, calls: list):
    self._name, self._jitted, self._calls = name, jitted, calls

  def __call__(self, *args, **kwargs):
    abstract = jax.tree.map(_abstract, (args, kwargs))
    self._calls.append((self._name, self._jitted, abstract))
    return self._jitted(*args, **kwargs)


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x


@contextlib.contextmanager
def recording(model):
  """Within the block, every compiled program `model` runs is recorded;
  yields a list that then holds (name, weights leaf count, optimized HLO
  text) per distinct program called.

    with hlo.recording(model) as programs:
      model.generate([model.prefill(chunk)], ...)
    for name, n_weights, text in programs:
      assert weight_copies(text, n_weights) == []
  """
  calls: list = []
  engines = {id(e): e for e in (model._prefill_engine, model._generate_engine)}
  undo = []
  for engine in engines.values():
    if hasattr(engine, "_programs"):  # ShardedEngine: programs by key
      make = engine._program

      def program(key, *a, _make=make, **kw):
        return _Recorder(str(key[0]), _make(key, *a, **kw), calls)

      engine._program = program
      undo.append((engine, "_program", None))
    else:  # the reference engine's three jitted functions
      for attr in ("_prefill", "_init", "_run"):
        jitted = getattr(engine, attr)
        setattr(engine, attr, _Recorder(attr[1:], jitted, calls))
        undo.append((engine, attr, jitted))
  programs: list = []
  try:
    yield programs
  finally:
    for engine, attr, old in undo:
      if old is None:
        del engine.__dict__[attr]
      else:
        setattr(engine, attr, old)
  seen = set()
  for name, jitted, (args, kwargs) in calls:
    text = jitted.lower(*args, **kwargs).compile().as_text()
    if text not in seen:
      seen.add(text)
      programs.append((name, len(jax.tree.leaves(args[0])), text))
