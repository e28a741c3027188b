"""README.md and docs/: every relative link resolves (files and their
headings), and every `scripts/NAME.py` command they show passes only
flags the script defines (those its import defines, as its `--helpfull`
lists them)."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.flag_checks import defined_flags

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"scripts/([a-z_0-9]+)\.py((?:[ \t]+[^ \t\n`|;&#]+)*)")


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped,
  spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
  fenced, out = False, set()
  for line in page.read_text().splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced and (m := re.match(r"^#+ (.*)$", line)):
      out.add(_slug(m.group(1)))
  return out


def test_docs_exist_and_the_front_page_is_short():
  assert len(PAGES) >= 10
  assert len((ROOT / "README.md").read_text().splitlines()) <= 320


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
  bad = []
  for target in LINK.findall(page.read_text()):
    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      bad.append(f"{target}: no file {file}")
    elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
      bad.append(f"{target}: no heading #{anchor} in {file.name}")
  assert not bad, f"{page.name}: {bad}"


def _commands() -> dict[str, set[str]]:
  """script -> every flag the pages pass it."""
  used: dict[str, set[str]] = {}
  for page in PAGES:
    text = re.sub(r"\\\n\s*", " ", page.read_text())  # continuations joined
    for name, args in COMMAND.findall(text):
      flags = {
        a[2:].split("=")[0] for a in args.split() if re.match(r"^--\w", a)
      }
      used.setdefault(name, set()).update(flags)
  return used


def test_every_scripts_command_names_flags_the_script_defines():
  used = _commands()
  assert {"benchmark", "score", "generate", "serve"} <= set(used)
  missing_scripts = [
    n for n in used if not (ROOT / "scripts" / f"{n}.py").exists()
  ]
  assert not missing_scripts, missing_scripts
  # (a command without flags has nothing to check)
  defined_by = defined_flags([n for n, flags in used.items() if flags], ROOT)
  unknown = {}
  for name, defined in defined_by.items():
    assert defined, f"scripts/{name}.py defines no flags"
    missing = {
      f
      for f in used[name]
      if f not in defined and not (f.startswith("no") and f[2:] in defined)
    }
    if missing:
      unknown[name] = sorted(missing)
  assert not unknown, f"flags the scripts do not define: {unknown}"
