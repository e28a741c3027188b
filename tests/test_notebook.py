"""notebooks/quickstart.ipynb is stored clean and runs top to bottom."""

import base64
import pathlib
import re

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def _read():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  return nb


def _outputs(nb):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_notebook_is_stored_without_outputs():
  nb = _read()
  assert nb.metadata.kernelspec.name == "python3"
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, "the notebook has no code cells"
  for cell in code:
    assert cell.outputs == [], cell.source
    assert cell.execution_count is None, cell.source


@pytest.mark.slow
def test_quickstart_runs_on_the_default_model():
  nb = _read()
  client = nbclient.NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",
    resources={"metadata": {"path": str(ROOT)}},
  )
  client.execute()  # raises CellExecutionError naming the failing cell
  outputs = _outputs(nb)
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.text for o in outputs if o.output_type == "stream")
  lines = text.splitlines()

  assert "smollm2-135m: 134.5M parameters" in text

  # Scoring: three sentences, the sensible word order is more likely.
  totals = [
    float(m.group(1))
    for line in lines
    if (m := re.match(r"'.*': log-prob (-?[\d.]+), perplexity [\d.]+$", line))
  ]
  assert len(totals) == 3, text
  assert totals[0] > totals[1]

  # The top-n table: a header, a separator and one row per non-BOS token of
  # "The cat sat on the mat.", each with the token and 5 alternatives.
  tables = [
    o.data["text/markdown"]
    for o in outputs
    if o.output_type == "display_data" and "text/markdown" in o.data
  ]
  assert len(tables) == 1, tables
  rows = [r for r in tables[0].splitlines() if r.startswith("|")]
  assert len(rows) >= 2 + 5, tables[0]
  assert rows[0].startswith("| pos | token | p(token) | top 1 |")
  for row in rows[2:]:
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert len(cells) == 3 + 5, row
    assert all(re.search(r"\d\.\d{3}$", c) for c in cells[3:]), row
  assert "`' mat'`" in tables[0]

  # The per-token log-prob plot is a PNG image.
  images = [
    o.data["image/png"]
    for o in outputs
    if o.output_type == "display_data" and "image/png" in o.data
  ]
  assert len(images) == 1
  assert base64.b64decode(images[0]).startswith(b"\x89PNG\r\n\x1a\n")

  # Few-shot: 3 tasks x 3 samples from one prefix; the model knows Rome.
  samples = [line for line in lines if line.startswith("sample ")]
  assert len(samples) == 9, text
  assert [int(s.split()[1]) for s in samples] == list(range(9))
  assert any("Rome" in s for s in samples if "Italy" in s)

  # Chat: greedy, streamed.
  answers = [line for line in lines if line.startswith("assistant: ")]
  assert len(answers) == 1, text
  assert "Paris" in answers[0]

  # The scoring job run from Python: same log-probs as section 2, and a
  # second run resumes with nothing left to do.
  assert "job summary: 3 examples" in text, text
  gap = re.search(r"largest difference ([\d.e+-]+)", text)
  assert gap and float(gap.group(1)) < 1e-3, text
  assert "second run: 0 run now, 3 resumed" in text, text
