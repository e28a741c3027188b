"""Reading compiled programs: where do the weights go, what is exchanged?

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

`collectives` lists every collective of a module with its bytes per
device and how often it runs (the trip counts of the loops around it):

  for op in collectives(text):
    print(op.kind, op.operand_bytes, op.result_bytes, op.times)

`parse` reads both the optimized text of `Compiled.as_text()` and the
unoptimized HLO of `Lowered.as_text(dialect="hlo")` (names without `%`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
  r"(?P<op>[a-z][a-z0-9\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
# A computation's header: "%name (params) -> shape {" when optimized,
# "name {" before.
_COMP = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*)?\{\s*$")
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
    named = re.findall(r"%([\w.\-]+)", self.args)
    return tuple(named or re.findall(r"[A-Za-z_][\w.\-]*", self.args))

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
    return self._params.get(computation, {}).get(number)

  def users(self, computation: str, name: str) -> list[tuple[Instr, list]]:
    """The instructions of `computation` that read `name`, each with the
    operand slots where they read it."""
    return self._users.get(computation, {}).get(name, [])

  # Indexes built on first use (a 118-layer module has ~10^5 lines).
  @functools.cached_property
  def _params(self) -> dict[str, dict[int, Instr]]:
    return {
      comp: {int(i.args): i for i in instrs if i.op == "parameter"}
      for comp, instrs in self.computations.items()
    }

  @functools.cached_property
  def _users(self) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for comp, instrs in self.computations.items():
      table = out.setdefault(comp, {})
      for i in instrs:
        slots: dict[str, list[int]] = {}
        for k, o in enumerate(i.operands):
          slots.setdefault(o, []).append(k)
        for o, ks in slots.items():
          table.setdefault(o, []).append((i, ks))
    return out


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
  return sorted(
    f"{comp}: %{user.name} = {user.op} {user.shape.split('{')[0]} "
    f"from weight parameter {weight}"
    for comp, user, weight in _weight_copies(
      parse(text), n_weights, min_elements
    )
  )


def weight_copy_sizes(
  text: str, n_weights: int, *, min_elements: int = 1024
) -> list[int]:
  """Bytes of each buffer made out of a whole weight, largest first:
  those `weight_copies` lists, and fusions that hold a matmul or lookup
  but copy the weight before it (e.g. XLA:CPU's f32 twins of bf16 and
  int8 weights, which its loop-invariant code motion hoists out of the
  decode loop and keeps for the whole run)."""
  module = parse(text)
  found = _weight_copies(module, n_weights, min_elements, strict=True)
  return sorted((shape_bytes(user.shape) for _, user, _ in found), reverse=True)


def _weight_copies(
  module: Module, n_weights: int, min_elements: int, strict: bool = False
):
  """{(computation, instruction, weight number)} of `weight_copies`."""
  tracked: _Tracked = {}
  sizes: dict[int, int] = {}
  for number in range(n_weights):
    p = module.param(module.entry, number)
    if p is not None and p.elements >= min_elements:
      tracked[(module.entry, p.name)] = {(): number}
      sizes[number] = p.elements
  found = set()
  work = list(tracked)
  while work:
    comp, name = work.pop()
    paths = tracked[(comp, name)]
    for user, slots in module.users(comp, name):
      for target, target_paths in _forward(module, comp, user, slots, paths):
        have = tracked.setdefault(target, {})
        if not target_paths.items() <= have.items():
          have.update(target_paths)
          work.append(target)
      weight = paths.get(())
      strict_slots = slots if strict else None
      if weight is not None and _copies(
        module, user, sizes[weight], strict_slots
      ):
        found.add((comp, user, weight))
  return found


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


def _copies(
  module: Module, user: Instr, weight_elements: int, slots=None
) -> bool:
  """Whether `user`, reading a whole weight, writes a copy of it. A fusion
  that holds a matmul or a lookup reads in place; given the weight's
  operand `slots`, only where the fusion hands the weight to one directly
  (else a fusion that dequantizes a weight and gathers its scales, as
  XLA:CPU's int8 dots do, would pass)."""
  if user.op in ("bitcast", "get-tuple-element", "tuple", "while", "call"):
    return False
  if user.op in _IN_PLACE or user.op in _COLLECTIVES:
    return False
  if user.op == "fusion":
    callee = user.attr("calls")
    if slots is None:
      ops = {i.op for i in module.computations[callee]}
      if ops & _IN_PLACE:
        return False
    elif all(_fused_in_place(module, callee, s) for s in slots):
      return False
  return user.elements >= weight_elements * _COPY_SHARE


def _fused_in_place(module: Module, callee: str, slot: int) -> bool:
  """Whether fused computation `callee` reads its parameter `slot` only
  through matmuls and lookups (bitcasts followed)."""
  param = module.param(callee, slot)
  names, users = {param.name}, []
  for i in module.computations[callee]:
    if names & set(i.operands):
      if i.op == "bitcast":
        names.add(i.name)
      else:
        users.append(i)
  return bool(users) and all(i.op in _IN_PLACE for i in users)


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


COLLECTIVE_KINDS = (
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "all-to-all",
  "collective-permute",
)
_ARRAY_TYPE = re.compile(r"\b([a-z]+)(\d*)(?:e\d+m\d+\w*)?\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (the sum over a tuple's arrays): bf16[4,8] is
  64, pred and 8-bit types take a byte per element."""
  total = 0
  for kind, bits, dims in _ARRAY_TYPE.findall(shape):
    width = 1 if kind == "pred" or not bits else max(int(bits) // 8, 1)
    total += width * math.prod(int(d) for d in dims.split(",") if d)
  return total


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction, per device and per execution."""

  kind: str  # one of COLLECTIVE_KINDS
  name: str
  computation: str
  operand_bytes: int
  result_bytes: int
  # Executions per run of the module: the product of the trip counts of
  # the while loops around it; None when one of them is not known at
  # compile time (a data-dependent loop), then counted once per iteration.
  times: int | None
  group: int = 0  # devices in each replica group (0: not printed)
  shape: str = ""  # of the result, without layout: "bf16[8,2048]"

  @property
  def full_bytes(self) -> int:
    """The full-size side: an all-gather's result, a reduce-scatter's
    operand, either side of the others."""
    return max(self.operand_bytes, self.result_bytes)

  @property
  def moved_bytes(self) -> float:
    """Bytes each device sends by a ring (or pairwise) algorithm: (k-1)/k
    of the full-size side for groups of k, twice that for an all-reduce,
    a collective-permute's whole operand."""
    if self.kind == "collective-permute" or self.group == 0:
      return float(self.operand_bytes)
    share = (self.group - 1) / self.group * self.full_bytes
    return 2 * share if self.kind == "all-reduce" else share


def collectives(text: str) -> list[Collective]:
  """Every collective of an HLO module (`parse`), with its bytes and its
  executions per run. Asynchronous pairs count once: operands at the
  `-start`, the result at the `-done`."""
  module = parse(text)
  times = _executions(module)
  out = []
  for comp, instrs in module.computations.items():
    if comp not in times:
      continue  # not reached from the entry (e.g. a reduction's body)
    shapes = {i.name: i.shape for i in instrs}
    done = {
      i.operands[0]: i.shape
      for i in instrs
      if i.op.endswith("-done") and i.operands
    }
    for i in instrs:
      kind = i.op.removesuffix("-start")
      if kind not in COLLECTIVE_KINDS:
        continue
      operands = sum(shape_bytes(shapes.get(o, "")) for o in i.operands)
      result = shape_bytes(done.get(i.name, i.shape))
      if i.op.endswith("-start") and i.name not in done:
        result = operands
      out.append(
        Collective(
          kind,
          i.name,
          comp,
          operands,
          result,
          times[comp],
          _group(i.attrs),
          re.sub(r"\{[^}]*\}", "", done.get(i.name, i.shape)),
        )
      )
  return out


def _group(attrs: str) -> int:
  """Devices per replica group: `replica_groups={{0,2},{1,3}}` or the
  iota form `replica_groups=[2,4]<=[8]` (groups of 4)."""
  m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
  if m:
    return len([d for d in m.group(1).split(",") if d.strip()])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
  return int(m.group(2)) if m else 0


def trip_count(
  instr: Instr, module: Module | None = None, caller: str = ""
) -> int | None:
  """A while loop's trip count: the compiler's annotation (optimized HLO),
  else, given the `module` and the `caller` computation, a counter that
  starts at a constant, steps by 1 and stops at a constant (the form of
  `fori_loop` before optimization); None when neither is found."""
  m = _TRIP.search(instr.attrs)
  if m:
    return int(m.group(1))
  if module is None:
    return None
  try:
    return _counted(module, instr, caller)
  except (KeyError, IndexError, ValueError, TypeError):
    return None


def _counted(module: Module, loop: Instr, caller: str) -> int | None:
  """The trip count of `while i < N: i += 1` from a constant start."""

  def named(comp):
    return {i.name: i for i in module.computations[comp]}

  def constant(instr):
    return int(instr.args) if instr.op == "constant" else None

  cond, body = named(loop.attr("condition")), named(loop.attr("body"))
  root = module.computations[loop.attr("condition")][-1]  # ROOT is last
  if root.op != "compare" or root.attr("direction") != "LT":
    return None
  counter, limit = (cond[o] for o in root.operands)
  if counter.op != "get-tuple-element" or constant(limit) is None:
    return None
  k = counter.attr("index")
  step = body[module.computations[loop.attr("body")][-1].operands[int(k)]]
  terms = [body[o] for o in step.operands]
  if step.op != "add" or sorted(i.op for i in terms) != [
    "constant",
    "get-tuple-element",
  ]:
    return None
  if {constant(i) for i in terms} != {1, None} or not any(
    i.attr("index") == k for i in terms
  ):
    return None
  init = named(caller)[loop.operands[0]]
  start = constant(named(caller)[init.operands[int(k)]])
  return None if start is None else max(constant(limit) - start, 0)


def _executions(module: Module) -> dict[str, int | None]:
  """Runs of each computation per run of the entry, following while loops
  (times their trip counts), calls, conditionals (each branch once) and
  asynchronous starts; None below a loop of unknown trip count."""
  out: dict[str, int | None] = {}

  def visit(comp: str, n: int | None) -> None:
    before = out.get(comp, 0)
    out[comp] = None if before is None or n is None else before + n
    for i in module.computations.get(comp, ()):
      if i.op == "while":
        trips = trip_count(i, module, comp)
        inner = None if n is None or trips is None else n * trips
        for key in ("body", "condition"):
          visit(i.attr(key), inner)
      elif i.op in ("call", "async-start"):
        visit(i.attr("to_apply") or i.attr("calls"), n)
      elif i.op == "conditional":
        for callee in re.findall(r"%?([\w.\-]+)", _branches(i.attrs)):
          visit(callee, n)

  visit(module.entry, 1)
  return out


def _branches(attrs: str) -> str:
  m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
  if m:
    return m.group(1)
  pair = re.findall(r"(?:true|false)_computation=(%?[\w.\-]+)", attrs)
  return ",".join(pair)
