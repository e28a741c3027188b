"""chunkwise beside llama.cpp on the same GGUF files, this CPU, side by side.

  npm install --prefix scripts/llamacpp node-llama-cpp@3.22.1   # once
  python scripts/compare_llamacpp.py --requantize=Q4_0,Q8_0 --runs=3

For each file (SmolLM2's Q4_1 file, and --requantize: the same file with
every Q4_1 matrix requantized from its values by the gguf package's
quantizer), each side runs in a process of its own, with the same thread
count: llama.cpp through node-llama-cpp's prebuilt CPU binaries
(`scripts/llamacpp/bench.mjs`), chunkwise with each --weights (native:
the file's blocks as they are; int8; float32). Each process prefills a
prompt of --prompt_tokens tokens, then decodes --steps tokens greedily,
--runs times after a first (compiling) run; the table gives medians and
each process's peak RSS (and, for chunkwise, "runtime": the peak before
it loaded the model, Python's, JAX's and XLA's own).

  python scripts/compare_llamacpp.py --quality --requantize=Q4_0,Q8_0

--quality measures instead how close the distributions are, on the texts
of scripts/data/eval_texts.jsonl (the same tokens on both sides, every
position after BOS): each chunkwise --weights against llama.cpp's own
next-token distribution on the same file (`scripts/llamacpp/probs.mjs`,
teacher-forced; top-1 agreement and KL(llama.cpp ‖ chunkwise) of the
whole vocabulary's distributions), and the native blocks against the
same file dequantized to f32 in chunkwise (`checkpoints.quality.measure`).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "scripts" / "llamacpp"
TEXT = "The history of the city begins with a small settlement by the river. "

_FILES = flags.DEFINE_list(
  "files", ["smollm2-135m"], "GGUF files (or smollm2-135m) to run."
)
_REQUANTIZE = flags.DEFINE_list(
  "requantize",
  [],
  "Also the first file with its Q4_1 matrices requantized "
  "to each of these gguf types (Q4_0, Q8_0, Q5_0, Q5_1).",
)
_WEIGHTS = flags.DEFINE_list(
  "weights",
  ["native", "native:q8", "int8", "int8:q8", "float32"],
  "chunkwise's weights per file, each as weights[:numerics] (native, "
  "int8 or float32; numerics as chunkwise.numerics names them, else the "
  "load's default).",
)
_THREADS = flags.DEFINE_integer("threads", 2, "Threads of each side.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 512, "Prefill length.")
_STEPS = flags.DEFINE_integer("steps", 64, "Greedy decode steps.")
_RUNS = flags.DEFINE_integer("runs", 3, "Timed runs after the first.")
_BATCHES = flags.DEFINE_list(
  "batches",
  ["1"],
  "Rows decoded together: 1 (a prompt of --prompt_tokens), and each larger "
  "batch b (b prompts of --batch_prompt_tokens, each its own sequence of "
  "one llama.cpp context); tok/s are the batch's aggregate.",
)
_BATCH_PROMPT = flags.DEFINE_integer(
  "batch_prompt_tokens", 64, "Each row's prompt length at batches > 1."
)
_SCORES = flags.DEFINE_bool(
  "scores",
  False,
  "chunkwise's prefill scores every prompt position (prefill(scores=True)); "
  "by default it computes the last position's logits alone, as llama.cpp's "
  "prompt evaluation does.",
)
_OUT = flags.DEFINE_string("out", "", "Also write the rows as JSON here.")
_QUALITY = flags.DEFINE_bool(
  "quality", False, "Measure distributions against llama.cpp, not speed."
)
_TEXTS = flags.DEFINE_string(
  "texts", str(ROOT / "scripts" / "data" / "eval_texts.jsonl"), "--quality's."
)
_CACHE = flags.DEFINE_string(
  "compilation_cache",
  "",
  "A directory for JAX's persistent compilation cache on chunkwise's side "
  "(chunkwise.compile_cache; '' = off, every program compiled in the "
  "process, its compiler's memory in the peak RSS). Run twice: the second "
  "run's programs come from the cache, as a restarted server's do.",
)
_CHILD = flags.DEFINE_string("child", "", "Internal: run one chunkwise side.")


def _resolve(name: str) -> str:
  import importlib

  return importlib.import_module("chunkwise.checkpoints.load").resolve(name)


def requantize(src: str, kind: str, out: str) -> str:
  """`src` with its Q4_1 matrices requantized to `kind` (gguf's own
  quantizer, from the dequantized values); every other tensor and all
  metadata copied."""
  import gguf
  import numpy as np
  from gguf import GGMLQuantizationType as QType
  from gguf import quants

  reader = gguf.GGUFReader(src)
  arch = reader.fields["general.architecture"].contents()
  writer = gguf.GGUFWriter(out, arch)
  for field in reader.fields.values():
    if field.name.startswith("GGUF.") or field.name == "general.architecture":
      continue
    sub = (
      field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    )
    writer.add_key_value(field.name, field.contents(), field.types[0], sub)
  target = QType[kind]
  for t in reader.tensors:
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type == QType.Q4_1:
      values = quants.dequantize(t.data, t.tensor_type).reshape(shape)
      writer.add_tensor(
        t.name, quants.quantize(values, target), raw_dtype=target
      )
    elif t.tensor_type in (QType.F32, QType.F16):
      writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
    else:
      writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return out


def _load(path: str, spec: str):
  """chunkwise's model of a --weights entry: weights[:numerics]."""
  import chunkwise as cw
  from chunkwise import numerics as numerics_lib

  weights, _, numerics = spec.partition(":")
  if weights not in ("native", "int8", "float32"):
    raise app.UsageError(
      f"--weights={spec!r}: expected native, int8 or float32"
    )
  if numerics and numerics not in numerics_lib.NUMERICS:
    raise app.UsageError(
      f"--weights={spec!r}: numerics {numerics!r} is not one of "
      f"{', '.join(numerics_lib.NUMERICS)}"
    )
  quantize = weights if weights in ("native", "int8") else None
  return cw.load(path, quantize=quantize, numerics=numerics or None)


def _child(spec: str) -> None:
  """One chunkwise side: prints one JSON line."""
  path, weights, _ = spec.split("|")
  import jax
  import jax.numpy as jnp
  import numpy as np

  import chunkwise as cw

  jax.devices()  # the runtime up, before any weight
  if _CACHE.value:
    from chunkwise import compile_cache

    compile_cache.enable(_CACHE.value)
  before = _hwm_mib(os.getpid())
  model = _load(path, weights)
  batch = int(_BATCHES.value[0])
  n = _prompt_len(batch)
  ids = np.asarray(_prompts(model.vocab.encode(TEXT), batch, n), np.int32)
  chunk = cw.Chunk(
    tokens=jnp.asarray(ids), lengths=jnp.full((batch,), n, jnp.int32)
  )
  prefill_s, decode_s, tokens = [], [], None
  for run in range(_RUNS.value + 1):
    t0 = time.perf_counter()
    first = model.prefill(chunk, scores=_SCORES.value)
    first.next_token_logits.block_until_ready()
    t1 = time.perf_counter()
    out, _ = model.generate(
      [first],
      sample_ids=np.arange(batch),
      steps=_STEPS.value,
      sampling=cw.Sampling(temperature=0.0),
    )
    tokens = np.asarray(out.tokens)[0].tolist()
    t2 = time.perf_counter()
    if run:  # the first compiles
      prefill_s.append(t1 - t0)
      decode_s.append((t2 - t1) / _STEPS.value)
  peak = _hwm_mib(os.getpid())
  print(
    json.dumps(
      dict(
        prefill_s=prefill_s,
        decode_s=decode_s,
        tokens=tokens,
        rss_before_mib=before,
        rss_peak_mib=peak,
      )
    )
  )


def _prefill_kind() -> str:
  if _SCORES.value:
    return "scores every position"
  return "computes the last position's logits only"


def _prompts(ids: list[int], batch: int, n: int) -> list[list[int]]:
  """`batch` prompts of n tokens: TEXT's tokens repeated, row i starting
  i tokens further in (llama.cpp's side cuts the same ones: bench.mjs)."""
  while len(ids) < n + batch:
    ids = ids + ids
  return [ids[i : i + n] for i in range(batch)]


def _hwm_mib(pid: int) -> float | None:
  """The process's peak resident set (VmHWM), None once it is gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


# chunkwise's side runs on JAX's CPU backend alone: with JAX's TPU plugin
# installed (the `tpu` extra), JAX would otherwise load libtpu into every
# process, ~100 MiB of resident pages no CPU run uses.
CPU_ONLY = {"JAX_PLATFORMS": "cpu"}


def _run(cmd: list[str], env: dict | None = None) -> tuple[dict, float]:
  """(the JSON line the command printed, its peak RSS in MiB: VmHWM read
  every 20 ms while it runs; getrusage's would count this process's own,
  which a child inherits across exec)."""
  peak = 0.0
  with tempfile.TemporaryFile("w+") as out:
    proc = subprocess.Popen(
      cmd,
      stdout=out,
      stderr=subprocess.DEVNULL,
      env=None if env is None else {**os.environ, **env},
    )
    while proc.poll() is None:
      peak = max(peak, _hwm_mib(proc.pid) or 0.0)
      time.sleep(0.02)
    out.seek(0)
    text = out.read()
  if proc.returncode:
    raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}): {text[-2000:]}")
  line = [x for x in text.splitlines() if x.startswith("{")][-1]
  return json.loads(line), peak


def _prompt_len(batch: int) -> int:
  return _PROMPT.value if batch == 1 else _BATCH_PROMPT.value


def _llamacpp(path: str, batch: int) -> dict:
  script = NODE_DIR / "bench.mjs"
  _need_node()
  result, rss = _run(
    [
      "node",
      str(script),
      path,
      str(_THREADS.value),
      str(_prompt_len(batch)),
      str(_STEPS.value),
      str(_RUNS.value + 1),
      str(batch),
    ]
  )
  result["prefill_s"] = result["prefill_s"][1:]
  result["decode_s"] = result["decode_s"][1:]
  result["rss_peak_mib"] = rss
  return result


def _chunkwise(path: str, weights: str, batch: int) -> dict:
  """chunkwise's side (JAX's CPU runtime uses every core: run this on a
  machine with --threads cores, as CI's has 2)."""
  result, rss = _run(
    [
      sys.executable,
      __file__,
      f"--child={path}|{weights}|{_THREADS.value}",
      f"--prompt_tokens={_PROMPT.value}",
      f"--batch_prompt_tokens={_BATCH_PROMPT.value}",
      f"--batches={batch}",
      f"--steps={_STEPS.value}",
      f"--runs={_RUNS.value}",
      f"--compilation_cache={_CACHE.value}",
      f"--scores={_SCORES.value}",
    ],
    env=CPU_ONLY,
  )
  result["rss_peak_mib"] = max(rss, result["rss_peak_mib"] or 0.0)
  return result


def _row(file: str, side: str, r: dict, ref: list | None, batch: int) -> dict:
  decode = statistics.median(r["decode_s"]) / batch
  same = None
  if ref is not None:
    n = min(len(ref), len(r["tokens"]))
    same = next((i for i in range(n) if ref[i] != r["tokens"][i]), n)
  return dict(
    file=os.path.basename(file),
    side=side,
    batch=batch,
    prefill_tok_s=batch
    * _prompt_len(batch)
    / statistics.median(r["prefill_s"]),
    decode_tok_s=1 / decode,
    rss_peak_mib=r["rss_peak_mib"],
    rss_before_mib=r.get("rss_before_mib"),
    greedy_tokens_as_llamacpp=same,
  )


def _need_node() -> None:
  if not (NODE_DIR / "node_modules" / "node-llama-cpp").exists():
    raise app.UsageError(
      f"node-llama-cpp is not installed: npm install --prefix {NODE_DIR}"
    )


def _quality(files: list[str]) -> list[dict]:
  """--quality's rows: every chunkwise --weights against llama.cpp on each
  file, and native against the file dequantized to f32."""
  import numpy as np

  from chunkwise.checkpoints import quality

  texts = quality.read_texts(_TEXTS.value)
  rows = []
  for path in files:
    models = {}
    for weights in dict.fromkeys([*_WEIGHTS.value, "float32"]):
      models[weights] = _load(path, weights)
    with tempfile.TemporaryDirectory() as tmp:
      tokens, out = f"{tmp}/rows.json", f"{tmp}/probs.f32"
      model = models["float32"]
      pathlib.Path(tokens).write_text(
        json.dumps(quality.token_rows(model.vocab, texts))
      )
      cmd = ["node", str(NODE_DIR / "probs.mjs"), path, str(_THREADS.value)]
      n = model.hparams.vocab
      subprocess.run([*cmd, tokens, out, str(n)], check=True)
      reference = np.fromfile(out, np.float32).reshape(-1, n)
    name = os.path.basename(path)
    for weights in _WEIGHTS.value:
      r = quality.against_reference(models[weights], texts, reference)
      rows.append(dict(file=name, candidate=weights, vs="llama.cpp", **r))
    for weights in models:
      if weights.startswith("native"):
        r = quality.measure(models["float32"], models[weights], texts)
        rows.append(dict(file=name, candidate=weights, vs="f32 same file", **r))
  return rows


def _print_quality(rows: list[dict]) -> None:
  print(
    f"{'file':40s} {'chunkwise':12s} {'against':16s} {'top-1':>7s} "
    f"{'mean KL':>9s} {'max KL':>9s}"
  )
  for r in rows:
    print(
      f"{r['file']:40s} {r['candidate']:12s} {r['vs']:16s} "
      f"{r['top1_agreement']:7.4f} {r['mean_kl']:9.2e} {r['max_kl']:9.2e}"
    )


def _mib(value) -> str:
  return "-" if value is None else f"{value:.0f}"


def _same(r: dict) -> str:
  n = r["greedy_tokens_as_llamacpp"]
  return "-" if n is None else f"{n}/{_STEPS.value}"


def main(argv):
  del argv
  if _CHILD.value:
    return _child(_CHILD.value)
  from chunkwise.cpu_kernels import isa

  files = [_resolve(f) for f in _FILES.value]
  work = pathlib.Path(tempfile.mkdtemp(prefix="requantized-"))
  for kind in _REQUANTIZE.value:
    out = work / f"{pathlib.Path(files[0]).stem}.{kind}.gguf"
    files.append(requantize(files[0], kind.upper(), str(out)))
  _need_node()
  if _QUALITY.value:
    rows = _quality(files)
    print(f"cpu: {isa.cpu_name()}, kernel path {isa.current()}")
    _print_quality(rows)
    if _OUT.value:
      pathlib.Path(_OUT.value).write_text(json.dumps(rows, indent=1))
    return
  rows = []
  for path in files:
    for batch in [int(b) for b in _BATCHES.value]:
      ref = _llamacpp(path, batch)
      rows.append(_row(path, "llama.cpp", ref, None, batch))
      for weights in _WEIGHTS.value:
        got = _chunkwise(path, weights, batch)
        side = f"chunkwise {weights}"
        rows.append(_row(path, side, got, ref["tokens"], batch))
      size = os.path.getsize(path) / 2**20
      for r in rows[-1 - len(_WEIGHTS.value) :]:
        r["file_mib"] = size
  print(
    f"cpu: {isa.cpu_name()}, kernel path {isa.current()}, "
    f"{_THREADS.value} threads, prompt {_PROMPT.value}, {_STEPS.value} steps, "
    f"chunkwise's prefill {_prefill_kind()}"
  )
  print(
    f"{'file':40s} {'side':20s} {'batch':>5s} {'decode tok/s':>12s} "
    f"{'prefill tok/s':>13s} "
    f"{'peak RSS MiB':>12s} {'runtime MiB':>11s} {'file MiB':>8s} "
    f"{'same greedy':>11s}"
  )
  for r in rows:
    print(
      f"{r['file']:40s} {r['side']:20s} {r['batch']:5d} "
      f"{r['decode_tok_s']:12.1f} "
      f"{r['prefill_tok_s']:13.1f} {r['rss_peak_mib']:12.0f} "
      f"{_mib(r['rss_before_mib']):>11s} {r['file_mib']:8.1f} {_same(r):>11s}"
    )
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  app.run(main)
