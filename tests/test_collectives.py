"""Collective matmuls against their naive twins (XLA collective + einsum)
and against numpy, per device under `shard_map` with `check_vma=True`, on
host CPU devices.

Each device gets its own random operands (a leading device axis split over
the ring), so a block read from the wrong device or in the wrong order
shows. Block sizes (per device and ring step) are odd and even."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from chunkwise import collectives as C
from chunkwise.collectives import ring

RINGS = [2, 4, 8]


def _mesh(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def _run(mesh, fn, *arrays, axes=("x",)):
  """fn per device on arrays whose axis 0 is split over `axes` (the result
  likewise)."""
  spec = P(tuple(mesh.axis_names))
  shard = NamedSharding(mesh, spec)
  f = jax.jit(
    jax.shard_map(
      lambda *xs: fn(*(x[0] for x in xs))[None],
      mesh=mesh,
      in_specs=(spec,) * len(arrays),
      out_specs=spec,
      check_vma=True,
    )
  )
  return np.asarray(f(*(jax.device_put(a, shard) for a in arrays)))


def _random(rng, shape):
  return rng.normal(size=shape).astype(np.float32)


def _forms(m, subsplits):
  """(variant, subsplit) pairs to test for blocks of size m."""
  forms = [("xla", None), ("one_way", None), ("latency", None)]
  if m % 2 == 0:  # the default subsplit halves each block
    forms.append(("throughput", None))
  return forms + [("throughput", s) for s in subsplits]


# (einsum, lhs shape, rhs shape for a scattered size, letter, subsplits)
RS_CASES = {
  "q": ("bte,ehd->bthd", (2, 3, 8), lambda s: (8, s, 4), "h", ["d"]),
  "mlp_in": ("bte,ef->btf", (3, 1, 6), lambda s: (6, s), "f", []),
  "out": ("bthd,hde->bte", (2, 2, 3, 4), lambda s: (3, 4, s), "e", []),
}


def _cut(variant, rhs, axes, dim):
  """The shuffled rhs cut into the pieces its ring steps read in place
  (whole where they read one piece)."""
  count = C.pieces(variant, ring.size(axes))
  return rhs if count == 1 else ring.split(rhs, dim, count)


def _rs_fn(variant, eq, axes, scatter, subsplit, cut=False):
  rletters = ring.parse(eq)[1]
  subdim = None if subsplit is None else rletters.index(subsplit)

  def f(lhs, rhs):
    dim = rletters.index(scatter)
    rhs = C.shuffle_for_reducescatter(
      variant, rhs, axes=axes, dim=dim, subdim=subdim
    )
    if cut:
      rhs = _cut(variant, rhs, axes, dim)
    return C.matmul_reducescatter(
      variant, eq, lhs, rhs, axes=axes, scatter=scatter, subsplit=subsplit
    )

  return f


@pytest.mark.parametrize("n", RINGS)
@pytest.mark.parametrize("case", sorted(RS_CASES))
@pytest.mark.parametrize("m", [1, 2, 3])
def test_matmul_reducescatter(n, case, m):
  eq, lshape, rshape, scatter, subsplits = RS_CASES[case]
  rng = np.random.default_rng([n, m, len(case)])
  lhs = _random(rng, (n, *lshape))
  rhs = _random(rng, (n, *rshape(n * m)))
  total = sum(np.einsum(eq, lhs[i], rhs[i]) for i in range(n))
  want = np.stack(np.split(total, n, axis=ring.parse(eq)[2].index(scatter)))
  _assert_forms(m, subsplits, lhs, rhs, want, _rs_fn, eq, scatter)


def _assert_forms(m, subsplits, lhs, rhs, want, make, eq, letter):
  """Every form on a ring of all devices, its weights cut into their ring
  pieces (as the layouts place them), and whole, the pieces sliced at
  each step, for one block size."""
  mesh = _mesh((lhs.shape[0],), ("x",))
  for variant, subsplit in _forms(m, subsplits):
    for cut in (True, False) if m == 1 else (True,):
      f = make(variant, eq, ("x",), letter, subsplit, cut)
      np.testing.assert_allclose(
        _run(mesh, f, lhs, rhs),
        want,
        rtol=1e-4,
        atol=1e-4,
        err_msg=f"{variant} / {subsplit} / cut={cut}",
      )


# (einsum, lhs shape for a gathered size, rhs shape for the whole size,
# gathered letter, subsplits)
AG_CASES = {
  "o": ("bthd,hde->bte", lambda s: (2, 3, s, 4), lambda s: (s, 4, 6), "h",
        ["d"]),
  "down": ("btf,fe->bte", lambda s: (2, 1, s), lambda s: (s, 5), "f", []),
  "q": ("bte,ehd->bthd", lambda s: (3, 2, s), lambda s: (s, 3, 2), "e", []),
}  # fmt: skip


def _ag_fn(variant, eq, axes, gather, subsplit, cut=False):
  rletters = ring.parse(eq)[1]
  subdim = None if subsplit is None else rletters.index(subsplit)

  def f(lhs, rhs):
    dim = rletters.index(gather)
    rhs = C.shuffle_for_allgather(
      variant, rhs, axes=axes, dim=dim, subdim=subdim
    )
    if cut:
      rhs = _cut(variant, rhs, axes, dim)
    return C.allgather_matmul(
      variant, eq, lhs, rhs, axes=axes, gather=gather, subsplit=subsplit
    )

  return f


@pytest.mark.parametrize("n", RINGS)
@pytest.mark.parametrize("case", sorted(AG_CASES))
@pytest.mark.parametrize("m", [1, 2, 3])
def test_allgather_matmul(n, case, m):
  eq, lshape, rshape, gather, subsplits = AG_CASES[case]
  rng = np.random.default_rng([n, m, len(case), 1])
  lhs = _random(rng, (n, *lshape(m)))
  rhs = _random(rng, (n, *rshape(n * m)))
  whole = np.concatenate(list(lhs), axis=ring.parse(eq)[0].index(gather))
  want = np.stack([np.einsum(eq, whole, rhs[i]) for i in range(n)])
  _assert_forms(m, subsplits, lhs, rhs, want, _ag_fn, eq, gather)


@pytest.mark.parametrize("axes", [("y", "z"), ("z", "x"), ("x", "y", "z")])
def test_rings_over_several_axes(axes):
  """A ring over several mesh axes (in any order) numbers devices like
  `lax.axis_index(axes)`, the order psum_scatter and all_gather use."""
  mesh = _mesh((2, 2, 2), ("x", "y", "z"))
  n = int(np.prod([mesh.shape[a] for a in axes]))
  rng = np.random.default_rng(len(axes))
  lhs = _random(rng, (8, 2, 1, 4))
  rhs = _random(rng, (8, 4, 2 * n, 3))
  for variant in C.VARIANTS:
    got, want = (
      _run(mesh, _rs_fn(v, "bte,ehd->bthd", axes, "h", None), lhs, rhs)
      for v in (variant, "xla")
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    lhs_ag = _random(rng, (8, 2, 1, 2))
    rhs_ag = _random(rng, (8, 2 * n, 3, 2))
    got, want = (
      _run(mesh, _ag_fn(v, "bte,ehd->bthd", axes, "e", None), lhs_ag, rhs_ag)
      for v in (variant, "xla")
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# Weight-gathered streaming: (einsum, lhs shape, rhs shape, rhs spec).
STREAM_CASES = {
  "q_wi": ("bte,ehd->bthd", (1, 3, 8), (8, 8, 6), ("x", ("y", "z"), None)),
  "o_wo": ("bthd,hde->bte", (1, 3, 8, 6), (8, 6, 8), (("y", "z"), None, "x")),
  "wi": ("bte,ef->btf", (1, 2, 8), (8, 12), (None, ("z", "y"))),
  "kv": ("bte,ehd->bthd", (1, 2, 8), (8, 1, 6), ("x", None, None)),
}


def _stream(variant, eq, x, w, rhs_axes, halves):
  if halves:  # the shard cut in two once, as the layout places it
    w = C.split_for_stream_throughput(w)
  return C.stream_matmul(variant, eq, x, w, rhs_axes=rhs_axes)


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
@pytest.mark.parametrize(
  "variant, halves",
  [(v, False) for v in C.VARIANTS] + [("throughput", True)],
)
def test_stream_matmul(case, variant, halves):
  eq, lshape, rshape, rspec = STREAM_CASES[case]
  mesh = _mesh((2, 2, 2), ("x", "y", "z"))
  rng = np.random.default_rng(len(case))
  lhs = _random(rng, (8, *lshape))  # each device's own rows
  rhs = _random(rng, rshape)
  rhs_axes = [() if a is None else (a,) if isinstance(a, str) else a
              for a in rspec]  # fmt: skip
  rows = P(("x", "y", "z"))
  f = jax.jit(
    jax.shard_map(
      lambda x, w: _stream(variant, eq, x[0], w, rhs_axes, halves)[None],
      mesh=mesh,
      in_specs=(rows, P(*rspec)),
      out_specs=rows,
      check_vma=True,
    )
  )
  got = f(
    jax.device_put(lhs, NamedSharding(mesh, rows)),
    jax.device_put(rhs, NamedSharding(mesh, P(*rspec))),
  )
  want = np.stack([np.einsum(eq, lhs[i], rhs) for i in range(8)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_shuffles_permute_blocks():
  """A shuffle only reorders whole blocks (or half blocks): every original
  value appears once, and device 0's latency order is the documented one."""
  mesh = _mesh((4,), ("x",))
  rhs = np.tile(np.arange(8, dtype=np.float32)[None, :, None], (4, 1, 2))

  def shuffled(fn):
    return _run(mesh, lambda w: fn(w, axes=("x",), dim=0), rhs)

  lat = shuffled(C.shuffle_for_reducescatter_latency)
  # n = 4, blocks of 2: device 0 chunk 0 = blocks [(0-0-2)%4, (0+0+2+1)%4]
  np.testing.assert_array_equal(lat[0, :4, 0], [4, 5, 6, 7])
  for fn in (
    C.shuffle_for_reducescatter_latency,
    C.shuffle_for_reducescatter_throughput,
    C.shuffle_for_allgather_latency,
    C.shuffle_for_allgather_throughput,
  ):
    out = shuffled(fn)
    for d in range(4):
      assert sorted(out[d, :, 0]) == list(range(8)), fn.__name__


def test_errors_name_the_problem():
  mesh3 = _mesh((3,), ("x",))
  lhs = np.ones((3, 1, 1, 2), np.float32)
  rhs = np.ones((3, 2, 6), np.float32)
  with pytest.raises(ValueError, match="odd size 3"):
    _run(mesh3, _rs_fn("latency", "bte,ef->btf", ("x",), "f", None), lhs, rhs)
  mesh2 = _mesh((2,), ("x",))
  with pytest.raises(ValueError, match="not divisible by the ring size 2"):
    _run(
      mesh2,
      _rs_fn("one_way", "bte,ef->btf", ("x",), "f", None),
      np.ones((2, 1, 1, 2), np.float32),
      np.ones((2, 2, 3), np.float32),
    )
  with pytest.raises(ValueError, match="must appear in the rhs and the output"):
    C.matmul_reducescatter_naive(
      "bte,ef->btf", lhs[0], rhs[0], axes=(), scatter="e"
    )
  with pytest.raises(ValueError, match="must be contracted"):
    C.allgather_matmul_naive("bte,ef->btf", lhs[0], rhs[0], axes=(), gather="f")
  with pytest.raises(ValueError, match="unknown collective variant 'fast'"):
    C.matmul_reducescatter(
      "fast", "bte,ef->btf", lhs[0], rhs[0], axes=(), scatter="f"
    )
