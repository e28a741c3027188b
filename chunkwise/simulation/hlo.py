"""Reading HLO text: a module's computations and instructions (`parse`),
its loops' trip counts, and the collectives it runs.

`collectives` lists every collective of a module with its bytes per
device and how often it runs (the trip counts of the loops around it):

  for op in collectives(text):
    print(op.kind, op.operand_bytes, op.result_bytes, op.times)

`parse` reads both the optimized text of `Compiled.as_text()` and the
unoptimized HLO of `Lowered.as_text(dialect="hlo")` (names without `%`).
Where the weights go in a compiled program is `weight_reads`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

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

  @property
  def total_elements(self) -> int:
    """Elements of the result (all of a tuple's arrays)."""
    return sum(
      math.prod(int(d) for d in dims.split(",") if d)
      for dims in _ARRAY.findall(self.shape)
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


@functools.lru_cache(maxsize=4)
def parse(text: str) -> Module:
  """The computations of an HLO module's text (`Compiled.as_text()`).
  Remembered for the last few texts: the simulation reads one compiled
  module's collectives, weight copies, cycles and kernels, each of them
  parsing it (a 118-layer module has ~10^5 lines); a `Module` is never
  changed after it is built."""
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


COLLECTIVE_KINDS = (
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "all-to-all",
  "collective-permute",
)
_ARRAY_TYPE = re.compile(r"\b([a-z]+)(\d*)(?:e\d+m\d+\w*)?\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"?(\d+)')
_NO_ESTIMATE = 1 << 62  # XLA:TPU writes INT64_MAX where it has none


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


_KERNEL_COST = re.compile(
  r'"cost_estimate"\s*:\s*\{\s*"flops"\s*:\s*"?(\d+)"?.*?'
  r'"bytes_accessed"\s*:\s*"?(\d+)'
)


def kernel_cycles(attrs: str, hardware) -> int | None:
  """A Pallas call's bound in cycles, where XLA:TPU gives it no estimate:
  the slower of its bytes at the chip's HBM bandwidth and its flops at its
  peak (the `cost_estimate` the call carries), at the chip's clock; None
  without one."""
  m = _KERNEL_COST.search(attrs)
  if m is None or hardware is None or not hardware.clock_hz:
    return None
  flops, nbytes = int(m.group(1)), int(m.group(2))
  seconds = max(nbytes / hardware.hbm_bandwidth, flops / hardware.flops)
  return round(seconds * hardware.clock_hz)


def estimated_cycles(text: str, hardware=None) -> dict[str, int]:
  """XLA:TPU's own estimate of a compiled module's time, in cycles (the
  `estimated_cycles` of each top-level instruction's backend config), but
  for its collectives, whose time depends on the interconnect:
  `once`, of what runs a known number of times (weighted by it), and
  `per_iteration`, of what runs inside a loop of unknown trip count (the
  decode loop: one step); `unknown`, the instructions it gave no estimate
  (INT64_MAX: fusions holding a Pallas call or a mixed int8 dot), left
  out of both. All 0 for a module without the annotation (XLA:CPU's).
  The compiler sums each op's slower of compute and memory and schedules
  nothing in parallel: read it relatively.

  XLA:TPU gives a Pallas call (a `tpu_custom_call`) no estimate; with the
  chip's `hardware` (`planner.hardware.Hardware`), each call that carries
  a cost estimate counts its bound (`kernel_cycles`) instead, and
  `bounded` how many calls were so counted (each execution once)."""
  out = dict(once=0, per_iteration=0, unknown=0, bounded=0)
  for _, cycles, times, kernel in _timed(text, hardware):
    if kernel:
      out["bounded"] += 1 if times is None else times
    if cycles >= _NO_ESTIMATE:
      out["unknown"] += 1
    elif times is None:
      out["per_iteration"] += cycles
    else:
      out["once"] += times * cycles
  return out


def _timed(text: str, hardware):
  """(instruction, cycles, executions or None in a loop of unknown trip
  count, whether a Pallas call's bound) of each instruction that has an
  estimate (`estimated_cycles`), collectives left out."""
  module = parse(text)
  times = _executions(module)
  for comp, instrs in module.computations.items():
    if comp not in times:
      continue
    for i in instrs:
      kind = i.op.removesuffix("-start").removesuffix("-done")
      m = _CYCLES.search(i.attrs)
      cycles = None if m is None else int(m.group(1))
      kernel = i.op == "custom-call" and '"tpu_custom_call"' in i.attrs
      if kernel:
        cycles = kernel_cycles(i.attrs, hardware)
      if cycles is None or kind in COLLECTIVE_KINDS:
        continue
      yield i, cycles, times[comp], kernel


# XLA:TPU estimates any op at no fewer than about 1,800 cycles, however
# few bytes it moves (1.2 µs on v5e): an op under this many is "small".
SMALL_OP_CYCLES = 2500


def step_ops(text: str, hardware=None) -> dict[str, dict[str, int]]:
  """Where one decode step's estimate goes (the instructions in a loop of
  unknown trip count, as `estimated_cycles`' `per_iteration`): per kind,
  `count` and `cycles` of the Pallas calls (at their bounds: what their
  bytes take), of the small ops (under `SMALL_OP_CYCLES` each: norms,
  RoPE, residual adds, a few rows' softmax; each costs the compiler's
  floor whatever it moves), and of the rest (attention over the cache,
  sampling over the vocabulary)."""
  out = {k: dict(count=0, cycles=0) for k in ("kernels", "small", "other")}
  for _, cycles, times, kernel in _timed(text, hardware):
    if times is not None or cycles >= _NO_ESTIMATE:
      continue
    kind = "kernels" if kernel else "other"
    if not kernel and cycles < SMALL_OP_CYCLES:
      kind = "small"
    out[kind]["count"] += 1
    out[kind]["cycles"] += cycles
  return out


def cycles_of(text: str, names) -> int:
  """The sum of XLA:TPU's `estimated_cycles` of the instructions `names`
  (without their %), each counted once (0 for one the compiler gave no
  estimate)."""
  wanted = set(names)
  return sum(
    cycles
    for i, cycles, _, _ in _timed(text, None)
    if i.name in wanted and cycles < _NO_ESTIMATE
  )


def tpu_kernels(text: str) -> dict[str, int]:
  """The Pallas / Mosaic kernels a compiled XLA:TPU module calls (its
  `tpu_custom_call`s, named by the kernel's `name=`), sorted by name: how
  many call sites each has."""
  counts = collections.Counter(
    i.name.rsplit(".", 1)[0]
    for instrs in parse(text).computations.values()
    for i in instrs
    if i.op == "custom-call" and '"tpu_custom_call"' in i.attrs
  )
  return dict(sorted(counts.items()))


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
