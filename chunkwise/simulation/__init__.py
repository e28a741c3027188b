"""Compile-only simulation: the engine's own programs compiled, from
abstract weights, for a mesh of fake host devices or for a real TPU slice
described by libtpu (no TPU attached), and read back: what each chip
holds, the collectives it runs, the weight copies the compiler makes,
XLA:TPU's estimated cycles, the Pallas kernels it calls, all beside the
planner's prediction (`scripts/simulate.py`).

  simulate.py      fitting a model to a mesh, the depth scaling, `run`
  programs.py      the programs traced on abstract inputs (prefill, the
                   generate loop, the slot loop with LoRA, speculation or
                   a paged pool)
  compiled.py      one program compiled: memory, collectives, cycles
  report.py        the prediction beside the planner's, the tables
  tpu_target.py    a TPU slice's devices (libtpu), the chip's clock
  hlo.py           compiled HLO read: collectives, loop trip counts,
                   estimated cycles (Pallas calls at their bytes' and
                   flops' bound), kernels
  weight_reads.py  the compiler's copies of whole weights

Nothing here runs a program; nothing else of chunkwise imports it (the
benchmarks' figures and `scripts/simulate.py` do).
"""
