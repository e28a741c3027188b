"""Converts a GGUF file, a Hugging Face directory (or a chunkwise checkpoint)
into a chunkwise Orbax checkpoint, optionally with int8 weights.

  python scripts/convert.py --input=smollm2-135m --output=/tmp/smollm2
  python scripts/convert.py --input=model.gguf --output=/tmp/m8 \\
      --quantize=int8
  python -c 'import chunkwise as cw; cw.load("/tmp/m8", layout="ws_2d",
      mesh=cw.partitioning.make_mesh((2, 2, 2)))'

The output holds the weights, HParams, BOS/EOS ids and the tokenizer (see
`chunkwise.checkpoints.manifest`); it is written to `<output>.partial` and
renamed when complete, so a failed run leaves nothing at `--output`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from absl import app, flags, logging

_INPUT = flags.DEFINE_string(
  "input", None, "Embedded model name, .gguf file or checkpoint directory."
)
_OUTPUT = flags.DEFINE_string("output", None, "Checkpoint directory to write.")
_QUANTIZE = flags.DEFINE_enum(
  "quantize", "none", ["none", "int8"], "Weight quantization."
)
_DTYPE = flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16"], "Float weights' dtype."
)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace an existing checkpoint at --output."
)


def convert(
  source: str,
  output: str,
  *,
  quantize: str | None = None,
  dtype: str | None = None,
  overwrite: bool = False,
) -> str:
  """Loads `source` (anything `cw.load` reads) and saves it at `output`."""
  import chunkwise as cw
  from chunkwise.models import quantized

  output = os.path.abspath(output)
  if os.path.exists(output) and not overwrite:
    raise FileExistsError(
      f"{output} already exists; pass --overwrite to replace it"
    )
  start = time.perf_counter()
  model = cw.load(source, dtype=dtype, quantize=quantize)
  path = cw.save(model, output, overwrite=overwrite)
  logging.info(
    "wrote %s: %.1fM parameters, %.1f MB of weights%s, in %.1f s",
    path,
    model.hparams.num_params() / 1e6,
    quantized.nbytes(model.weights) / 1e6,
    ", int8" if quantize else "",
    time.perf_counter() - start,
  )
  return path


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for flag in (_INPUT, _OUTPUT):
    if not flag.value:
      raise app.UsageError(f"--{flag.name} is required")
  try:
    path = convert(
      _INPUT.value,
      _OUTPUT.value,
      quantize=None if _QUANTIZE.value == "none" else _QUANTIZE.value,
      dtype=_DTYPE.value,
      overwrite=_OVERWRITE.value,
    )
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"convert.py: {e}", file=sys.stderr)
    sys.exit(1)
  print(path)


if __name__ == "__main__":
  app.run(main)
