"""Does a compiled program read its weights in place?

DESIGN §6 asks decode and prefill to read every weight once, in place. A
compiled program breaks that rule when an instruction other than a matmul
(or a collective, which moves shards between devices by design) turns a
weight into a new buffer of comparable size: a `copy`, a slice or dynamic
slice of a stacked array, a transpose, a dequantizing `convert`.
`weight_copies` follows each weight parameter of an optimized HLO module
(`hlo.parse`) through the plumbing that does not touch its bytes
(bitcasts, tuples, while loops, calls) and lists every such consumer.

  text = jitted.lower(weights, ...).compile().as_text()
  assert weight_copies(text, len(jax.tree.leaves(weights))) == []

The weights must be the program's first parameters (chunkwise's programs
all take them first). `recording` collects the programs a model runs, to
check each of them.
"""

from __future__ import annotations

import contextlib
import re

import jax

from chunkwise.simulation.hlo import Instr, Module, parse, shape_bytes

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
# A layout's memory space past HBM ("S(1)": XLA:TPU's VMEM): a weight's
# slice prefetched there is staged for a matmul, not copied in HBM.
_FAST_MEMORY = re.compile(r":[^{}]*S\([1-9]\d*\)")
# A consumer whose output has at least this share of the weight's elements
# has copied it (a slice of a stacked [layers, ...] weight is one layer).
_COPY_SHARE = 1 / 8


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
  return input_copies(text, range(n_weights), min_elements=min_elements)


def input_copies(
  text: str,
  numbers,
  *,
  min_elements: int = 1024,
  what: str = "weight",
  staging: bool = True,
) -> list[str]:
  """`weight_copies` of the parameters numbered `numbers` (any inputs
  read in place: a prefix's K/V cache too), each line naming `what`.
  `staging=False`: a copy into VMEM counts too where it changes the
  input's layout (a K/V cache small enough to fit there is copied in
  whole: in its own layout that is a prefetch, in another a relayout).
  A K/V input's copy counts all the arrays a fusion writes (XLA:TPU cut
  a prefix cache into one window per layer and head, 1/16 each)."""
  found = _weight_copies(
    parse(text),
    numbers,
    min_elements,
    staging=staging,
    pieces=what == "K/V",
  )
  return sorted(
    f"{comp}: %{user.name} = {user.op} {user.shape.split('{')[0]} "
    f"from {what} parameter {number}"
    for comp, user, number in found
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
  found = _weight_copies(module, range(n_weights), min_elements, strict=True)
  return sorted((shape_bytes(user.shape) for _, user, _ in found), reverse=True)


def _weight_copies(
  module: Module,
  numbers,
  min_elements: int,
  strict: bool = False,
  staging: bool = True,
  pieces: bool = False,
):
  """{(computation, instruction, parameter number)} of `input_copies`."""
  tracked: _Tracked = {}
  sizes: dict[int, int] = {}
  orders: dict[int, tuple[int, ...] | None] = {}
  for number in numbers:
    p = module.param(module.entry, number)
    if p is not None and p.elements >= min_elements:
      tracked[(module.entry, p.name)] = {(): number}
      sizes[number] = p.elements
      orders[number] = None if staging else _order(p.shape)
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
      if weight is not None and _copies(
        module,
        comp,
        user,
        sizes[weight],
        slots,
        strict=strict,
        order=orders[weight],
        pieces=pieces,
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
  module: Module,
  comp: str,
  user: Instr,
  weight_elements: int,
  slots,
  *,
  strict: bool = False,
  order: tuple[int, ...] | None = None,
  pieces: bool = False,
) -> bool:
  """Whether `user`, reading a whole weight at its operand `slots`, writes
  a copy of it. A fusion that holds a matmul or a lookup reads in place;
  `strict`, only where the fusion hands the weight to one directly (else
  a fusion that dequantizes a weight and gathers its scales, as XLA:CPU's
  int8 dots do, would pass). A slice or copy into a faster memory (XLA:TPU
  prefetching a weight's blocks into VMEM) is staging, unless `order` (the
  input's minor-to-major) is given and it changes. `pieces`: what a fusion
  writes is all of its outputs, not the largest. A fusion whose root
  updates a slice of the input (at one of `slots`) writes it in place, as
  the bare op does (XLA fuses a decode loop's K/V buffer write with its
  update's relayout)."""
  if user.op in ("bitcast", "get-tuple-element", "tuple", "while", "call"):
    return False
  if _staged(module, comp, user) and order in (None, _order(user.shape)):
    return False
  if user.op in _IN_PLACE or user.op in _COLLECTIVES:
    return False
  if user.op == "dynamic-update-slice":  # written in place (a K/V buffer)
    return False
  if user.op == "fusion":
    callee = user.attr("calls")
    if any(_updated_in_place(module, callee, s) for s in slots):
      return False
    if not strict:
      ops = {i.op for i in module.computations[callee]}
      if ops & _IN_PLACE:
        return False
    elif all(_fused_in_place(module, callee, s) for s in slots):
      return False
  written = user.total_elements if pieces else user.elements
  return written >= weight_elements * _COPY_SHARE


def _order(shape: str) -> tuple[int, ...] | None:
  """The minor-to-major order of a shape's (first) array, without its
  dimensions of size 1 (where they go moves no byte)."""
  m = re.search(r"\[([\d,]*)\]\{([\d,]*)", shape)
  if m is None:
    return None
  dims = [int(d) for d in m.group(1).split(",") if d]
  return tuple(int(d) for d in m.group(2).split(",") if d and dims[int(d)] != 1)


def _staged(module: Module, comp: str, user: Instr) -> bool:
  """Whether `user` puts what it reads in a memory past HBM: its own
  layout says so, or (an asynchronous start) its `-done`'s does."""
  if user.op.endswith("-start"):
    done = [
      u for u, _ in module.users(comp, user.name) if u.op.endswith("-done")
    ]
    return bool(done) and all(_FAST_MEMORY.search(u.shape) for u in done)
  return bool(_FAST_MEMORY.search(user.shape))


def _updated_in_place(module: Module, callee: str, slot: int) -> bool:
  """Whether fused computation `callee`'s root is a dynamic-update-slice
  into its parameter `slot` (bitcasts followed)."""
  body = module.computations[callee]
  param = module.param(callee, slot)
  if param is None or body[-1].op != "dynamic-update-slice":
    return False
  names = {param.name}
  for i in body:
    if i.op == "bitcast" and names & set(i.operands):
      names.add(i.name)
  return body[-1].operands[0] in names


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

    with weight_reads.recording(model) as programs:
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
