"""Fast-forward (`Constraint(fast_forward=True)`, `lazy.forced_tokens`):
where a constraint allows one byte sequence only, one token is allowed
(the longest spelling a prefix of it), on the host and on the device,
and budget forcing's distances follow the same rule; JSON written
compact (`JsonSchema(whitespace="compact")`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkwise as cw
from chunkwise.checkpoints.load import embedded_path
from chunkwise.constraints import lazy
from chunkwise.processors.base import StepInfo
from tests.dfa_helpers import plain_token_distance

C = cw.constraints

SCHEMA = {
  "type": "object",
  "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "alerts": {"type": "boolean"},
  },
  "required": ["city", "unit"],
}
CORPUS = {
  "flexible": C.JsonSchema(SCHEMA, fast_forward=True),
  "compact": C.JsonSchema(SCHEMA, whitespace="compact", fast_forward=True),
  "frame": C.Regex(
    r'<tool_call>\n\{"name": "(get_weather|get_time)", "arguments": '
    r'\{"city": "[A-Z][a-z]{1,9}"\}\}\n</tool_call>',
    fast_forward=True,
  ),
  "choice": C.Choice(
    ["celsius", "centigrade", "fahrenheit"], fast_forward=True
  ),
}


@pytest.fixture(scope="module")
def smol_vocab():
  _, vocab = cw.checkpoints.gguf.describe(embedded_path("smollm2-135m"))
  return vocab


def _compiled(smol_vocab, name) -> lazy.Lazy:
  width = len(smol_vocab.token_bytes())
  return CORPUS[name].compile(
    smol_vocab, stop_ids=tuple(smol_vocab.eos_ids), width=width
  )


def _plain_forced(masks: lazy.Lazy) -> np.ndarray:
  """The plain twin of `lazy.forced_tokens`: each state's forced run
  followed in Python, the longest token spelling a prefix of it looked up
  among the tokens' bytes; none where a token spells the whole run and
  goes on with a byte the DFA allows after it."""
  dfa, trie = masks.dfa, masks.trie
  stops = set(masks._stops.tolist())
  spelled = {}
  for i in np.flatnonzero(trie.token_node >= 0).tolist():
    if i not in stops:
      spelled.setdefault(bytes(trie.token_bytes[i, : trie.token_length[i]]), i)
  longest = max(map(len, spelled))
  goes_on = {}  # a token's proper prefix -> the bytes that follow it
  for t in spelled:
    for k in range(1, len(t)):
      goes_on.setdefault(t[:k], set()).add(t[k])
  out = np.full(dfa.states, -1, np.int32)
  for s in range(dfa.states):
    run, at = b"", s
    while len(run) < longest and not dfa.final[at]:
      moves = np.flatnonzero(dfa.table[at] >= 0)
      if moves.size != 1:
        break
      run += bytes([int(moves[0])])
      at = int(dfa.table[at, moves[0]])
    crosses = any(dfa.table[at, b] >= 0 for b in goes_on.get(run, ()))
    for k in range(len(run), 0, -1):
      if run[:k] in spelled and not crosses:
        out[s] = spelled[run[:k]]
        break
  return out


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_forced_tokens_are_the_plain_walk(smol_vocab, name):
  masks = _compiled(smol_vocab, name)
  want = _plain_forced(masks)
  assert (want >= 0).sum() > 3, name  # forced runs exist
  np.testing.assert_array_equal(masks.forced_ids, want)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_forced_states_allow_their_token_alone(smol_vocab, name):
  """On a forced state the host mask is that one token, leading where
  the DFA takes its bytes; the distances are the plain walk's with that
  token as each forced state's first."""
  masks = _compiled(smol_vocab, name)
  for s in np.flatnonzero(masks.forced_ids >= 0).tolist():
    token = int(masks.forced_ids[s])
    np.testing.assert_array_equal(masks.allowed(s), [token])
    spelled = bytes(
      masks.trie.token_bytes[token, : masks.trie.token_length[token]]
    )
    assert masks.step(s, token) == masks.dfa.run(spelled, s)
  plain = plain_token_distance(
    masks.dfa, masks.trie, masks._stops, masks.forced_ids
  )
  np.testing.assert_array_equal(masks.distance, plain)
  numpy_twin = lazy.token_distance(
    masks.dfa, masks.trie, masks._stops, masks._forced, native=False
  )
  np.testing.assert_array_equal(numpy_twin, plain)


def test_the_device_walk_is_the_host_walk_with_forced_rows(smol_vocab):
  """`WalkProcessor.apply` gives every row the host's mask: rows all in
  forced states (the trie not walked) and forced rows beside walked
  ones; `update` moves each to the host's next state."""
  width = len(smol_vocab.token_bytes())
  stops = tuple(smol_vocab.eos_ids)
  masks = _compiled(smol_vocab, "compact")
  walker = C.walk.processor((), [masks], trie=masks.trie)
  forcing = C.walk.processor((), [masks], trie=masks.trie, force=True)
  forced = np.flatnonzero(masks.forced_ids >= 0)[:6].tolist()
  free = np.flatnonzero(masks.forced_ids < 0)[:6].tolist()
  apply, update = jax.jit(type(walker).apply), jax.jit(type(walker).update)
  # All forced (nothing walks); few rows; more rows than `walk.FEW` with
  # at most FEW walking (only they walk), and with more (all walk).
  for states in (
    forced,
    forced[:2] + free[:2],
    free[:3] + forced[:3],
    forced[:2] + free,
  ):
    info = StepInfo(
      generated=jnp.zeros(len(states), jnp.int32),
      remaining=jnp.int32(1000),
      stop_ids=jnp.asarray(stops, jnp.int32),
    )
    g = jnp.ones(len(states), jnp.int32)
    s = jnp.asarray(states, jnp.int32)
    out = np.asarray(
      apply(walker, (g, s), jnp.zeros((len(states), width)), info)
    )
    for state, row in zip(states, out, strict=True):
      np.testing.assert_array_equal(
        np.flatnonzero(row == 0), masks.allowed(state)
      )
    tokens = [int(masks.allowed(x)[0]) for x in states]
    _, moved = update(walker, (g, s), jnp.asarray(tokens, jnp.int32), info)
    want = [masks.step(x, t) for x, t in zip(states, tokens, strict=True)]
    np.testing.assert_array_equal(np.asarray(moved), want)
    # Budget forcing with each row's distance + 1 columns left: a forced
    # row's one id still fits (its end's distance is one less).
    tight = StepInfo(
      generated=jnp.zeros(len(states), jnp.int32),
      remaining=jnp.asarray(masks.distance[states] + 1, jnp.int32),
      stop_ids=jnp.asarray(stops, jnp.int32),
    )
    out = np.asarray(
      apply(forcing, (g, s), jnp.zeros((len(states), width)), tight)
    )
    for state, row in zip(states, out, strict=True):
      if masks.forced_ids[state] >= 0:
        assert np.flatnonzero(row == 0).tolist() == [masks.forced_ids[state]]
      else:
        assert np.isin(np.flatnonzero(row == 0), masks.allowed(state)).all()


def test_compact_json_has_no_whitespace_and_validates(smol_vocab):
  c = C.JsonSchema(SCHEMA, whitespace="compact")
  assert "[ ]" not in c.regex()
  masks = _compiled(smol_vocab, "compact")
  assert masks.dfa.matches(b'{"city":"Lyon","unit":"celsius","days":3}')
  assert not masks.dfa.matches(b'{"city": "Lyon", "unit": "celsius"}')
  assert c.validate('{"city":"Lyon","unit":"celsius"}').valid


def test_bad_options_are_named(smol_vocab):
  with pytest.raises(ValueError, match=r"whitespace must be one of.*'tight'"):
    C.JsonSchema(SCHEMA, whitespace="tight")
  with pytest.raises(ValueError, match="fast_forward must be True or False"):
    C.Regex("a+", fast_forward="yes")
  with (
    C.constraint.tables_kind("eager"),
    pytest.raises(ValueError, match="fast_forward=True needs lazy tables"),
  ):
    C.Regex("ab", fast_forward=True).compile(
      smol_vocab, stop_ids=[0], width=len(smol_vocab.token_bytes())
    )


class _Letters:
  """A vocabulary of a stop, the letters a-y alone (no "z"), and "zz"."""

  def token_bytes(self):
    return [None] + [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxy"] + [b"zz"]


@pytest.mark.parametrize(
  "pattern, spellable",
  [
    ("a+", True),
    ("a|z", True),
    ("zz", True),
    ("z", False),
    ("za", False),
  ],
)
def test_text_no_token_spells_is_refused(pattern, spellable):
  """A constraint whose start no token can begin is refused: known at
  once where each byte the DFA reads is a token alone, else walked."""

  def compile():
    return C.Regex(pattern).compile(_Letters(), stop_ids=[0], width=27)

  if spellable:
    assert compile().allowed(0).size
  else:
    with pytest.raises(ValueError, match="matches no text this vocabulary"):
      compile()
