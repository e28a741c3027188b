"""DESIGN.md §1's dependency direction, read from every module's imports.

A package may import only packages above it:
configs -> collectives, processors -> partitioning, constraints -> models
-> inference -> checkpoints -> jobs, serving -> bench (which measures
all of them: the scoring job's batches among them) -> simulation (which
compiles them for meshes and TPU slices); checkpoints, jobs and
serving use only the names `chunkwise.inference` exports. The
single-module helpers (contract, untrusted, precision, compile_cache,
numerics, memory, cpu_kernels, tpu_kernels) import nothing
above the floor they serve; `contract` (activation times weight in the
weight's own order) imports nothing at all, like `configs`.
"""

import ast
import pathlib

import pytest

import chunkwise.inference

ROOT = pathlib.Path(__file__).parents[1] / "chunkwise"

FLOORS = {
  "configs": 0,
  "contract": 0,  # imports nothing; collectives and models use it
  "collectives": 1,
  "processors": 1,
  "cpu_kernels": 1,
  "tpu_kernels": 1,  # Pallas kernels; import nothing of ours
  "untrusted": 1,
  "precision": 1,
  "compile_cache": 1,  # JAX's persistent cache; imports nothing of ours
  "numerics": 2,  # contract's invariant override, over cpu_kernels
  "partitioning": 2,
  "constraints": 2,
  "memory": 2,
  "models": 3,
  "planner": 4,  # above models (it reads fused.needs_shuffle), below inference
  "inference": 5,
  "checkpoints": 6,
  "jobs": 7,
  "serving": 7,  # beside jobs: neither imports the other
  "bench": 8,  # measures everything below, the jobs included
  "simulation": 9,  # compiles everything below (bench's random adapters)
}
PUBLIC_ONLY = ("checkpoints", "jobs", "serving")


def _package(module: str) -> str | None:
  parts = module.split(".")
  if parts[0] != "chunkwise" or len(parts) < 2:
    return None
  return parts[1]


def _imports(path: pathlib.Path):
  """(imported module, names) of every `import` / `from ... import`."""
  tree = ast.parse(path.read_text(), str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      yield node.module, tuple(a.name for a in node.names)


def _modules():
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    yield ".".join(rel.parts), path


@pytest.mark.parametrize(
  "module,path", list(_modules()), ids=[m for m, _ in _modules()]
)
def test_imports_point_up(module, path):
  here = _package(module)
  if here not in FLOORS:  # chunkwise/__init__.py: the public surface
    assert module == "chunkwise.__init__", module
    return
  for imported, names in _imports(path):
    there = _package(imported)
    if there is None or there == here:
      continue
    assert there in FLOORS, f"{module} imports unknown {imported}"
    assert FLOORS[there] < FLOORS[here], (
      f"{module} (floor {FLOORS[here]}) imports {imported} "
      f"(floor {FLOORS[there]}): imports must point up"
    )
    if here in PUBLIC_ONLY and there == "inference":
      assert imported == "chunkwise.inference", (
        f"{module} imports {imported}: use chunkwise.inference's names"
      )
      hidden = set(names) - set(chunkwise.inference.__all__)
      assert not hidden, f"{module} imports unexported {sorted(hidden)}"


def test_every_package_has_a_floor():
  packages = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name[0] != "_"}
  modules = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
  assert (packages | modules) - {"__pycache__"} <= set(FLOORS), sorted(
    (packages | modules) - set(FLOORS)
  )


def _module_graph() -> dict[str, set[str]]:
  """Each module's imports of other chunkwise modules, every import
  counted: at the top, inside functions and under TYPE_CHECKING alike."""
  names = {}
  for module, path in _modules():
    names[module.removesuffix(".__init__")] = path
  graph = {}
  for module, path in names.items():
    out = set()
    for imported, imported_names in _imports(path):
      for target in (imported, *(f"{imported}.{n}" for n in imported_names)):
        # A package's own __init__ is not a module it imports back.
        if target in names and not module.startswith(target + "."):
          out.add(target)
    graph[module] = out - {module}
  return graph


def test_no_module_imports_one_that_imports_it_back():
  """No import circle of any length between chunkwise's modules (a lazy
  or TYPE_CHECKING import that hides one still counts)."""
  graph = _module_graph()
  index, low, stack, on, circles = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  assert not circles, f"import circles: {circles}"


# Inside `inference`, each sub-package's modules stand on a floor of their
# own (the sub-packages' docstrings say the same): an inference module may
# import inference modules on its floor or below. The most specific key
# names a module's floor; the top-level modules not listed are the core.
INFERENCE_FLOORS = {
  "": 0,  # the core: chunks, results, K/V, sampling, logits, plain loops
  "speculation": 0,  # its __init__ re-exports `settings`, below the loops
  "speculation.settings": 0,
  "speculation.calibration": 0,  # timed from the host; imports settings
  "paging": 0,
  "batching.slots": 1,  # the device loop and the requests' checks
  "batching.slot_requests": 1,
  "batching.live_requests": 1,
  "batching.rows": 1,  # a segment over some slots (device side)
  "batching.buckets": 1,  # which slots a segment runs (host side)
  "batching.segments": 1,  # a live segment's report, read after the next
  "speculation.draft": 1,
  "speculation.verify": 1,
  "speculation.speculative": 1,
  "engines": 2,  # compile the core's, slots' and speculation's loops
  "batching.admission": 3,  # the slot loops' host side, over engines
  "batching.continuous": 3,
  "batching.live": 3,
  "batching.heads": 3,  # prefix-cache hits compiled in the background
  "batching.warmup": 3,
  "batching": 1,  # its __init__ (a docstring) is below all its modules
  "model_setup": 4,
  "model": 4,
}


def _inference_floor(module: str) -> int | None:
  """`module`'s floor inside inference, None for chunkwise.inference
  itself (the package's exports) and for modules outside it."""
  prefix = "chunkwise.inference."
  if not module.startswith(prefix):
    return None
  rest = module.removeprefix(prefix).removesuffix(".__init__")
  parts = rest.split(".")
  for n in range(len(parts), 0, -1):
    key = ".".join(parts[:n])
    if key in INFERENCE_FLOORS:
      return INFERENCE_FLOORS[key]
  assert len(parts) == 1, f"{module}: no floor in INFERENCE_FLOORS"
  return INFERENCE_FLOORS[""]


def test_inference_sub_packages_import_down():
  graph = _module_graph()
  checked = 0
  for module, imported in graph.items():
    here = _inference_floor(module)
    if here is None:
      continue
    for target in imported:
      there = _inference_floor(target)
      if there is None:
        assert target != "chunkwise.inference", (
          f"{module} imports chunkwise.inference's exports: import the module"
        )
        continue
      checked += 1
      assert there <= here, (
        f"{module} (inference floor {here}) imports {target} (floor {there})"
      )
  assert checked > 100, checked  # the graph saw inference's imports


def test_inference_sub_packages_say_what_they_hold():
  for init in sorted((ROOT / "inference").glob("*/__init__.py")):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    modules = {p.stem for p in init.parent.glob("*.py")} - {"__init__"}
    missing = {m for m in modules if m not in doc}
    assert not missing, f"{init.parent.name}'s docstring omits {missing}"
    assert "may import" in doc, f"{init.parent.name}: say what it may import"
