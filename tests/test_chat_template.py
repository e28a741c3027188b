"""Chat templates are untrusted code: rendered in a sandbox, as
transformers renders them (tests/fuzz_inputs.py fuzzes them further)."""

import os

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

import chunkwise as cw
from chunkwise.checkpoints.chat_template import ChatTemplate, ChatTemplateError
from tests import fuzz_inputs

# A Llama-3-style template (written for this test): BOS, a system header
# with today's date (strftime_now), tools as indented JSON (tojson), roles
# checked with raise_exception, the generation prompt.
LLAMA3_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
  {%- set system = messages[0]['content'] | trim %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{%- if tools is not none %}
  {%- for t in tools %}{{- t | tojson(indent=2) + "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system + "<|eot_id|>" }}
{%- for m in messages %}
  {%- if m['role'] not in ['user', 'assistant'] %}
    {{- raise_exception("Unknown role: " + m['role']) }}
  {%- endif %}
  {{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}
  {{- m['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

CHATS = {
  "one turn": [{"role": "user", "content": "Hi ✓ 🐄"}],
  "system and turns": [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": 'And "é"?'},
  ],
}
TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "weather",
      "description": "Wetter in München",
      "parameters": {"type": "object", "properties": {"city": {}}},
    },
  }
]


@pytest.fixture(scope="module")
def smol_template():
  return cw.checkpoints.describe("smollm2-135m").vocab.chat_template


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("which", ["smollm2", "llama3-style"])
def test_renders_as_transformers(smol_template, which, chat, generation_prompt):
  text = smol_template if which == "smollm2" else LLAMA3_STYLE
  tools = TOOLS if which == "llama3-style" else None
  kwargs = {"bos_token": "<s>", "eos_token": "</s>"}
  (want,), _ = render_jinja_template(
    conversations=[CHATS[chat]],
    tools=tools,
    chat_template=text,
    add_generation_prompt=generation_prompt,
    **kwargs,
  )
  got = ChatTemplate(text, which).render(
    CHATS[chat], add_generation_prompt=generation_prompt, tools=tools, **kwargs
  )
  assert got == want
  assert ("München" in got) == (tools is not None)  # ensure_ascii=False


def test_raise_exception_keeps_the_templates_message():
  chat = [{"role": "tool", "content": "x"}]
  with pytest.raises(
    ChatTemplateError, match=r"chat template of m.gguf: .*Unknown role: tool"
  ):
    ChatTemplate(LLAMA3_STYLE, "m.gguf").render(chat)


EXPLOITS = {
  "globals": "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
  "class": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
  "os": "{{ os.system('touch PWNED') }}",
  "import": "{% import 'os' as os %}{{ os.system('touch PWNED') }}",
  "self": "{{ self.__init__.__globals__['__builtins__'] }}",
  "namespace": "{% set ns = namespace(__class__=1) %}{{ ns }}",
  "format": "{{ '{0.__class__.__mro__}'.format(1) }}",
}


@pytest.mark.parametrize("name", sorted(EXPLOITS))
def test_template_escapes_are_refused_and_nothing_runs(
  tmp_path, monkeypatch, name
):
  monkeypatch.chdir(tmp_path)
  path = tmp_path / "evil.gguf"
  fuzz_inputs.write_gguf(path, template=EXPLOITS[name])
  model = cw.load(path)  # loading never renders
  with pytest.raises(ValueError) as e:
    model.vocab.apply_chat_template([{"role": "user", "content": "hi"}])
  assert isinstance(e.value, ChatTemplateError)
  assert f"chat template of {path}: tokenizer.chat_template" in str(e.value)
  assert not os.path.exists(tmp_path / "PWNED")


@pytest.mark.parametrize(
  "text, reason",
  [
    ("{{ 'x' * 100000000 }}", "'\\*' would build 100000000"),
    ("{{ '%999999999d' % 1 }}", "width of 999999999"),
    ("{{ '{:999999999}'.format(1) }}", "width of 999999999"),
    ("{{ 'x'|center(999999999) }}", "filter 'center'"),
    ("{{ 'x'.ljust(999999999) }}", "calling"),
    ("{{ 2 ** 99999999 }}", "bits"),
    ("{% for i in range(10**9) %}{% endfor %}", "would build 1000000000"),
    (
      "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}"
      "{% endfor %}{% endfor %}",
      "longer than 1048576 characters",
    ),
    (  # doubling with `~` or `+`: refused at the size limit, not in memory
      '{% set ns = namespace(s="x") %}{% for i in range(40) %}'
      "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
      "'~' would build 2097152",
    ),
    (
      '{% set ns = namespace(s="x") %}{% for i in range(40) %}'
      "{% set ns.s = ns.s + ns.s %}{% endfor %}",
      "'\\+' would build 2097152",
    ),
    ("{{ x", "syntax error at line 1"),
    ("{{ undefined_thing.attr }}", "'undefined_thing' is undefined"),
  ],
)
def test_template_resources_are_bounded(text, reason):
  with pytest.raises(ChatTemplateError, match=reason):
    ChatTemplate(text, "t").render([{"role": "user", "content": "hi"}])


SPIN = (  # loops that call nothing: 10^15 iterations
  "{% for i in range(99999) %}{% for j in range(99999) %}"
  "{% for k in range(99999) %}{% endfor %}{% endfor %}{% endfor %}"
)


def test_an_empty_loop_stops_at_the_time_limit_per_render(monkeypatch):
  """Loops count against the time budget, and each render keeps its own:
  another render finishing meanwhile (in another thread) does not lift
  it."""
  import threading

  from chunkwise.checkpoints import chat_template

  monkeypatch.setattr(chat_template, "TIME_LIMIT_S", 0.5)
  spin, quick = ChatTemplate(SPIN, "t"), ChatTemplate("{{ 1 }}", "q")
  errors = []

  def run():
    try:
      spin.render([{"role": "user", "content": "hi"}])
    except ChatTemplateError as e:
      errors.append(str(e))

  t = threading.Thread(target=run, daemon=True)
  t.start()
  while t.is_alive() and not errors:
    quick.render([])  # renders of another template, and of this one:
    with pytest.raises(ChatTemplateError, match="longer than"):
      spin.render([])  # each stops at its own limit
    t.join(0.05)
  t.join(30)
  assert not t.is_alive() and "longer than 0.5 s" in errors[0]


def test_messages_reach_the_template_as_plain_data():
  class Rich(str):
    def danger(self):
      raise AssertionError("reached")

  text = "{{ messages[0].content.danger() }}"
  with pytest.raises(ChatTemplateError):
    ChatTemplate(text, "t").render([{"role": "user", "content": Rich("x")}])
  got = ChatTemplate("{{ messages[0].content }}", "t").render(
    [{"role": "user", "content": object()}]
  )
  assert got == "<object>"
