"""Engines: weights placed for one layout, and their compiled programs.

  engine          `make_engines`, the `Engine` protocol and the
                  single-device engine; program caches and prefix inputs.
  sharded_engine  `ShardedEngine`: one jitted `shard_map` program per phase
                  and plan on a mesh.
  mesh_programs   `MeshPrograms`: the sharded engine's base (programs
                  built once per key, inputs placed on the mesh).

What it may import: the inference core (prefill, generate, results, K/V),
`batching.slots` and `speculation` (the device loops an engine compiles);
the host side of `batching` and `InferenceModel` import engines, never
the reverse.
"""
