"""The native regex compiler (`constraints/regex_dfa.cc`) spells exactly
what outlines-core's DFA over bytes spells (its plain twin,
`automaton._outlines_dfa`), with no more states (it minimizes): on a
corpus of hand-written and schema regexes and on random regexes; what is
outside its subset is left to outlines-core (None), never guessed."""

import json

import numpy as np
import pytest

from chunkwise.constraints import automaton, byte_dfa, regex_dfa
from tests.dfa_helpers import same_language
from tests.test_lazy_masks import REGEXES, SCHEMAS

# outlines-core's DFA is compiled followed by an end mark, U+10FFFE
# (`automaton._marked_index`); a string that holds that noncharacter
# must end there in its DFA, a quirk the native one does not share.
MARK = "\U0010fffe".encode()

CORPUS = {
  **REGEXES,
  **{
    f"schema-{name}": automaton.regex_of("schema", json.dumps(s))
    for name, s in SCHEMAS.items()
  },
  "escapes": r"\.\*\+\?\(\)\[\]\{\}\|\^\$\\\/\-\"\n\t\r\x41\x{1F600}\u00e9",
  "class-edges": r"[-a][a-][]a][^]a][\]\-\\^]",
  "negated": r'[^"\\\x00-\x1F\x7F-\x9F]{0,4}',
  "neg-classes": r"[\D\S][^\w\s]\W",
  "counts": r"(ab|c){2}x{0,3}y{2,}z{1,2}?",
  "alternation": r"|a|ab|abc|(|x)y",
  "named": r"(?P<first>a+)(?<second>b*)",
  "end-anchor": r"(ab)+$",
  "lazy": r"a*?b+?c??",
  "astral": r"[\u{1F600}-\u{1F64F}]+|[\x{10000}-\x{10FFFF}]",
  "email": r'"[\w.+-]+@[\w-]+(\.[\w-]+)+"',
  "uri": r'"(https?|ftp)://[^\s/$.?#].[^\s]*"',
  "date-time": r'"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}'
  r'(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})"',
  "uuid": r'"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}"',
}


def _native(regex: str) -> dict | None:
  out = regex_dfa.build(regex, 10**6, automaton._class_ranges)
  return None if out is None else {"table": out.table, "final": out.final}


def _twin(regex: str) -> dict:
  return automaton._outlines_dfa(regex, automaton._BYTE_VOCAB, (256,), 257)


@pytest.fixture(scope="module", autouse=True)
def _library():
  if regex_dfa.library() is None:
    pytest.skip("no C++ compiler: regexes compile with outlines-core only")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_native_dfa_spells_what_outlines_spells(name):
  got, want = _native(CORPUS[name]), _twin(CORPUS[name])
  assert got is not None, f"{name} is in the native subset"
  assert same_language(got, want, without=MARK) >= want["table"].shape[0] - 4
  assert got["table"].shape[0] <= want["table"].shape[0]
  # trimmed: every state reached from 0 and reaching a final state
  assert (
    byte_dfa.ByteDfa("", got["table"], got["final"], 0.0).distance() < 2**30
  ).all()


def test_anchors_first_and_last_match_the_whole_text():
  same_language(_native(r"^(ab)+$"), _twin(r"(ab)+"))


def test_the_native_dfa_is_minimal():
  # outlines' DFA keeps the two ways to "ab"; the minimal one has 3 states
  got = _native(r"ab|a[b]|(a)(b)")
  assert got["table"].shape[0] == 3
  assert _native("")["final"].tolist() == [True]
  nothing = _native(r"[^\x00-\x{10FFFF}]")
  assert not nothing["final"][0] and (nothing["table"][0] < 0).all()


@pytest.mark.parametrize(
  "regex",
  [
    r"(?i)abc",  # flags
    r"\bword\b",  # word boundaries
    r"\p{L}+",  # Unicode properties
    r"[[:alpha:]]",  # POSIX classes
    r"[a-z&&[^aeiou]]",  # class set operations
    r"a{2}{3}",  # stacked repetitions
    r"(?=a)a",  # look-around
    r"a^b",  # an anchor inside
    r"(ab",  # syntax errors: outlines-core says what is wrong
    r"a{3,2}",
    r"a{,3}",
  ],
)
def test_what_is_outside_the_subset_goes_to_outlines(regex):
  assert _native(regex) is None


def test_too_many_states_is_an_error_before_the_table():
  with pytest.raises(regex_dfa.TooManyStates):
    regex_dfa.build(r"[a-z]{0,300}", 100)
  with pytest.raises(automaton.UserError, match=r"max_table_mb=0\.001"):
    automaton.byte_dfa(r"[a-z]{0,300}", 0.001, 257)


def test_code_points_read_a_class_back():
  dfa = _native(r"[a-c\u00e9\x{1F600}-\x{1F602}]")
  np.testing.assert_array_equal(
    regex_dfa.code_points(dfa["table"], dfa["final"]),
    [[0x61, 0x63], [0xE9, 0xE9], [0x1F600, 0x1F602]],
  )


def _random_regex(rng, depth=0) -> str:
  """A random regex over a few letters, classes and every operator both
  engines take."""
  kind = rng.integers(0, 9 if depth < 3 else 4)
  if kind == 0:
    return str(rng.choice(["a", "b", "é", "\\.", "\\x{1F600}"]))
  if kind == 1:
    return str(rng.choice(["[ab]", "[^a]", "[a-cé]", ".", "\\d", "[^\\s]"]))
  if kind in (2, 3):
    return str(rng.choice(["ab", "ba", "c"]))
  if kind in (4, 5):
    n = int(rng.integers(2, 4))
    return "".join(_random_regex(rng, depth + 1) for _ in range(n))
  if kind == 6:
    n = int(rng.integers(2, 4))
    return "(" + "|".join(_random_regex(rng, depth + 1) for _ in range(n)) + ")"
  inner = "(?:" + _random_regex(rng, depth + 1) + ")"
  return inner + str(
    rng.choice(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?"])
  )


def test_random_regexes_spell_what_outlines_spells():
  rng = np.random.default_rng(0)
  for _ in range(150):
    regex = _random_regex(rng)
    got, want = _native(regex), _twin(regex)
    assert got is not None, regex
    same_language(got, want, without=MARK)
    assert got["table"].shape[0] <= want["table"].shape[0], regex


@pytest.mark.parametrize("name", ["string", "nested", "schema-object", "uri"])
def test_minimal_merges_what_spells_the_same(name):
  """`minimal` (what spliced DFAs are trimmed with) of the native DFA
  doubled (every state twice, each transition to either copy at random,
  an unreachable and a dead state added) is the native DFA again, state
  for state; from another start, the DFA of what follows it there."""
  native = _native(CORPUS[name])
  table, final = native["table"], native["final"]
  n = table.shape[0]
  rng = np.random.default_rng(n)
  doubled = np.concatenate([table, table])
  doubled = np.where(
    doubled >= 0, doubled + n * rng.integers(0, 2, doubled.shape), -1
  )
  doubled = np.concatenate([doubled, np.full((2, 256), 2 * n + 1)])  # dead
  doubled[0, 0] = 2 * n + 1 if table[0, 0] < 0 else doubled[0, 0]
  twice = np.concatenate([final, final, [False, False]])
  got = regex_dfa.minimal(doubled.astype(np.int32), twice)
  assert got.table.shape[0] == n
  assert same_language({"table": got.table, "final": got.final}, native) == n
  start = int(table[0][table[0] >= 0][0])  # after the first byte
  after = regex_dfa.minimal(doubled.astype(np.int32), twice, start + n)
  plain = automaton._splicer().reached(table, final, start)
  same_language(
    {"table": after.table, "final": after.final},
    {"table": plain[0], "final": plain[1]},
  )


def test_the_unicode_classes_are_read_once_then_from_disk(
  tmp_path, monkeypatch
):
  monkeypatch.setenv("CHUNKWISE_KERNEL_CACHE", str(tmp_path))
  asked = []

  def classes(letter):
    asked.append(letter)
    return automaton._class_ranges(letter)

  first = regex_dfa.cached_classes(classes, "v1")
  digits = first("d")
  assert sorted(asked) == ["d", "s", "w"]  # all three, written at once
  again = regex_dfa.cached_classes(classes, "v1")
  np.testing.assert_array_equal(again("d"), digits)
  np.testing.assert_array_equal(again("w"), automaton._class_ranges("w"))
  assert len(asked) == 3  # read back, not asked again
  assert [0x30, 0x39] in digits.tolist()  # ASCII digits among Unicode's


def test_a_regex_outside_the_subset_compiles_through_outlines():
  """Through the public path (the worker): a flag the native compiler
  does not take is outlines-core's to compile, and it still masks."""
  dfa = byte_dfa.compile(r"(?i)ab[0-9]")
  assert dfa.matches(b"AB1") and dfa.matches(b"aB2")
  assert not dfa.matches(b"ac1")
  native = byte_dfa.compile(r"[aA][bB][0-9]")
  same_language(
    {"table": dfa.table, "final": dfa.final},
    {"table": native.table, "final": native.final},
  )
