"""The token explorer page (`/explore`) in headless Chromium against the
real server: SmolLM2 with a LoRA adapter, behind an API key.

A generation streams into token elements that carry their log-probs,
alternatives and constraint flags (the server's own numbers); Stop frees
the slot (/metrics); scoring shows `model.prefill`'s log-probs and
compares the base model with the adapter; errors are readable messages;
model output that reads `<script>` stays text; the page keeps to its
Content-Security-Policy and fits a narrow window. Each mode's screenshot
is written to $CHUNKWISE_SCREENSHOTS (the README's come from
`CHUNKWISE_SCREENSHOTS=docs python -m pytest tests/test_explore.py`).

Needs Chromium and its driver (Debian: `apt-get install chromium
chromium-driver`; `.ci/run` installs them): skipped without them, except
under CI, where that fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import numpy as np
import pytest
import text_generation
from safetensors.numpy import save_file

import chunkwise as cw
from tests.serving_helpers import running, served_as
from tests.test_jobs_adapters import PREFIX

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
KEY = "explorer-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DRIVER = shutil.which("chromedriver")
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
if not (DRIVER and BROWSER):
  if os.environ.get("CI"):
    raise RuntimeError(
      "CI needs chromium and chromedriver (apt-get install chromium "
      "chromium-driver; .ci/run installs them)"
    )
  pytest.skip("needs chromium and chromedriver", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

COLOUR = {
  "type": "object",
  "properties": {"colour": {"enum": ["red", "green", "blue"]}},
  "required": ["colour"],
  "additionalProperties": False,
}
# Model output that would run if it were written as markup.
HOSTILE = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"


def _write_adapter(directory: pathlib.Path, h) -> str:
  """A PEFT LoRA directory (q_proj, v_proj; rank 4) for SmolLM2."""
  directory.mkdir(parents=True)
  rng = np.random.default_rng(0)
  shapes = {
    "q_proj": h.heads * h.head_dim,
    "v_proj": h.kv_heads * h.head_dim,
  }
  tensors = {}
  for layer in range(h.layers):
    for module, outs in shapes.items():
      name = f"{PREFIX}{layer}.self_attn.{module}"
      tensors[f"{name}.lora_A.weight"] = rng.normal(
        scale=0.05, size=(4, h.d_model)
      ).astype(np.float32)
      tensors[f"{name}.lora_B.weight"] = rng.normal(
        scale=0.05, size=(outs, 4)
      ).astype(np.float32)
  save_file(tensors, str(directory / "adapter_model.safetensors"))
  config = dict(
    peft_type="LORA", r=4, lora_alpha=8, target_modules=list(shapes)
  )
  (directory / "adapter_config.json").write_text(json.dumps(config))
  return str(directory)


@pytest.fixture(scope="module")
def model(smollm2_first_layers):
  return cw.load(str(smollm2_first_layers))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory, smollm2_first_layers):
  adapter = _write_adapter(
    tmp_path_factory.mktemp("explore") / "tuned", model.hparams
  )
  with running(
    *served_as(smollm2_first_layers, MODEL),
    f"--adapters=tuned={adapter}",
    "--slots=2",
    "--max_total_tokens=512",
    "--warm_up=false",
    "--max_top_n=5",
    f"--api_key={KEY}",
  ) as s:
    yield s


@pytest.fixture(scope="module")
def browser():
  options = webdriver.ChromeOptions()
  options.binary_location = BROWSER
  for flag in (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
  ):
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(
    options=options, service=webdriver.ChromeService(executable_path=DRIVER)
  )
  driver.set_script_timeout(30)
  try:
    yield driver
  finally:
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> pathlib.Path:
  where = os.environ.get("CHUNKWISE_SCREENSHOTS")
  path = pathlib.Path(where) if where else tmp_path_factory.mktemp("shots")
  path.mkdir(parents=True, exist_ok=True)
  return path


def _wait(browser, condition, timeout=60.0):
  return WebDriverWait(browser, timeout, poll_frequency=0.05).until(
    lambda d: condition(d)
  )


def _open(browser, server, key=KEY):
  """Loads the page; with `key`, connects with it."""
  browser.get(server.url + "/explore")
  _wait(
    browser,
    lambda d: d.execute_script("return document.readyState") == "complete",
  )
  if key is not None:
    field = browser.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key, Keys.ENTER)
    _wait(browser, lambda d: d.find_element(By.ID, "server").text)


def _set(browser, element_id: str, value) -> None:
  e = browser.find_element(By.ID, element_id)
  e.clear()
  e.send_keys(str(value))


def _tokens(browser, within: str):
  """The token elements' data under the element `within` (CSS)."""
  return browser.execute_script(
    """
    const all = document.querySelectorAll(arguments[0] + ' .tok');
    return Array.from(all).map((t) => ({
      text: t.textContent, id: t.dataset.id, logprob: t.dataset.logprob,
      top: JSON.parse(t.dataset.top), forced: t.dataset.forced,
      disagree: t.classList.contains('disagree'), diff: t.dataset.diff}));
    """,
    within,
  )


def _state(browser, element_id: str) -> str:
  return browser.find_element(By.ID, element_id).get_attribute("data-state")


def _error(browser) -> str:
  box = browser.find_element(By.ID, "error")
  return "" if box.get_attribute("hidden") is not None else box.text


def _csp_violations(browser) -> list[str]:
  return [
    entry["message"]
    for entry in browser.get_log("browser")
    if "Content Security Policy" in entry["message"]
  ]


def _cancelled(server) -> float:
  try:
    return server.metric('tgi_request_failure{err="cancelled"}', AUTH)
  except KeyError:
    return 0.0


def _no_alert(browser) -> bool:
  try:
    browser.switch_to.alert.dismiss()
  except NoAlertPresentException:
    return True
  return False


def test_page_is_static_locked_down_and_keyless(server):
  """The page's files need no key and hold none; the API still does; the
  CSP allows this origin's files only; no inline code anywhere."""
  status, html = server.get("/explore")
  assert status == 200
  status, _ = server.get("/v1/models")
  assert status == 401
  import urllib.request

  with urllib.request.urlopen(server.url + "/explore") as r:
    csp = r.headers["Content-Security-Policy"]
    assert r.headers["Content-Type"].startswith("text/html")
    assert r.headers["X-Content-Type-Options"] == "nosniff"
  assert "script-src 'self'" in csp and "default-src 'none'" in csp
  assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
  for name in ("explore.js", "explore.css"):
    status, body = server.get(f"/explore/{name}")
    assert status == 200 and KEY.encode() not in body
  assert server.get("/explore/explore.html")[0] == 404
  with urllib.request.urlopen(server.url + "/explore/") as r:  # redirected
    assert r.url == server.url + "/explore" and r.read() == html
  assert server.get("/explore/nothing.js")[0] == 404
  text = html.decode()
  assert KEY not in text
  assert " style=" not in text and " on" + "click" not in text
  for tag in text.split("<script")[1:]:
    assert "src=" in tag.split(">")[0]  # no inline script
    assert tag.split(">", 1)[1].startswith("</script>")


def test_generate_streams_tokens_with_alternatives(browser, server, shots):
  # Without the key: a readable message, not a broken page.
  _open(browser, server, key=None)
  _wait(browser, lambda d: _error(d))
  assert "API key" in _error(browser)
  _open(browser, server)
  assert not _error(browser)
  _set(browser, "prompt", "The three primary colours are")
  _set(browser, "max-tokens", 40)
  _set(browser, "gen-top-n", 5)
  # Each change to the token list, with the time and the count it shows.
  browser.execute_script(
    """const out = document.getElementById('gen-out');
    window.arrivals = [];
    new MutationObserver(() => window.arrivals.push(
      [performance.now(), out.querySelectorAll('.tok').length])
    ).observe(out, {childList: true});"""
  )
  browser.find_element(By.ID, "gen-start").click()
  _wait(browser, lambda d: _state(d, "gen-out") != "running", 120)
  assert _state(browser, "gen-out") == "done", _error(browser)
  shown = _tokens(browser, "#gen-out")
  # It streamed: tokens came in many separate changes, spread over time.
  arrivals = browser.execute_script("return window.arrivals")
  counts = {n for _, n in arrivals if 0 < n < len(shown)}
  assert len(counts) >= 10, arrivals
  assert arrivals[-1][0] - arrivals[1][0] > 100  # ms
  # The server's own numbers for the same request (greedy).
  want = text_generation.Client(server.url, headers=AUTH, timeout=120).generate(
    "The three primary colours are", max_new_tokens=40, top_n_tokens=5
  )
  assert [int(t["id"]) for t in shown] == [t.id for t in want.details.tokens]
  np.testing.assert_allclose(
    [float(t["logprob"]) for t in shown],
    [t.logprob for t in want.details.tokens],
    rtol=0,
    atol=1e-6,
  )
  for t, top in zip(shown, want.details.top_tokens, strict=True):
    assert [a["id"] for a in t["top"]] == [a.id for a in top]
    assert t["top"][0]["id"] == int(t["id"])  # greedy: the likeliest
    assert t["forced"] is None  # no constraint, no flag
  assert "".join(t["text"] for t in shown) == want.generated_text
  stats = browser.find_element(By.ID, "gen-stats").text
  assert "time to first token" in stats and "tokens/s" in stats
  # Hover: the card lists the alternatives; Tab moves to the next token.
  spans = browser.find_elements(By.CSS_SELECTOR, "#gen-out .tok")
  ActionChains(browser).move_to_element(spans[3]).perform()
  card = browser.find_element(By.ID, "card")
  _wait(browser, lambda d: card.is_displayed())
  assert len(card.find_elements(By.CSS_SELECTOR, "tr")) == 5
  assert "probability" in card.text
  browser.save_screenshot(str(shots / "explore-generate.png"))
  # The keyboard: the list is one tab stop, the arrow keys move in it.
  spans[0].click()
  spans[0].send_keys(Keys.ARROW_RIGHT)
  spans[1].send_keys(Keys.ARROW_RIGHT)
  assert browser.switch_to.active_element == spans[2]
  text = json.dumps(shown[2]["text"], ensure_ascii=False)
  _wait(browser, lambda d: text in card.text)
  assert spans[2].get_attribute("aria-label").startswith(text)
  assert spans[2].get_attribute("aria-describedby") == "card"
  tabindex = [e.get_attribute("tabindex") for e in spans[:4]]
  assert tabindex == ["-1", "-1", "0", "-1"]
  spans[2].send_keys(Keys.TAB)
  assert browser.switch_to.active_element.get_attribute("class") != "tok"
  assert not _csp_violations(browser)


def test_constraint_flags_and_hostile_output_stays_text(browser, server):
  """A regex forces the model to write markup: it shows as text, nothing
  runs, each token says whether the constraint forced it."""
  _open(browser, server)
  Select(browser.find_element(By.ID, "constraint-kind")).select_by_value(
    "regex"
  )
  _set(browser, "constraint", cw.constraints.escape(HOSTILE))
  _set(browser, "prompt", "Some HTML:")
  _set(browser, "max-tokens", 60)
  browser.find_element(By.ID, "gen-start").click()
  _wait(browser, lambda d: _state(d, "gen-out") != "running")
  assert _state(browser, "gen-out") == "done", _error(browser)
  shown = _tokens(browser, "#gen-out")
  assert "".join(t["text"] for t in shown[:-1]) == HOSTILE
  assert all(t["forced"] in ("true", "false") for t in shown)
  # After the whole pattern only the end of text is allowed.
  assert shown[-1]["forced"] == "true"
  out = browser.find_element(By.ID, "gen-out")
  assert not out.find_elements(By.CSS_SELECTOR, "script, img")
  # Only token spans, each holding text alone.
  assert browser.execute_script(
    """return Array.from(arguments[0].querySelectorAll('*')).every(
      (e) => e.matches('span.tok') && e.childElementCount === 0);""",
    out,
  )
  assert browser.execute_script("return window.pwned") is None
  assert _no_alert(browser)


def test_chat_messages_with_a_json_schema(browser, server):
  """Chat mode (OpenAI's chat route): the messages go through the chat
  template, the schema holds, each token has its alternatives and says
  whether the schema forced it."""
  _open(browser, server)
  browser.find_element(By.CSS_SELECTOR, 'input[value="chat"]').click()
  assert not browser.find_element(By.ID, "prompt").is_displayed()
  browser.find_element(By.ID, "add-message").click()
  boxes = browser.find_elements(By.CSS_SELECTOR, "#message-list textarea")
  assert len(boxes) == 2
  boxes[1].send_keys("Pick one.")
  Select(browser.find_element(By.ID, "constraint-kind")).select_by_value("json")
  _set(browser, "constraint", json.dumps(COLOUR))
  _set(browser, "max-tokens", 24)
  browser.find_element(By.ID, "gen-start").click()
  _wait(browser, lambda d: _state(d, "gen-out") != "running")
  assert _state(browser, "gen-out") == "done", _error(browser)
  shown = _tokens(browser, "#gen-out")
  reply = json.loads("".join(t["text"] for t in shown))
  assert reply["colour"] in COLOUR["properties"]["colour"]["enum"]
  assert all(len(t["top"]) == 5 for t in shown)
  flags = [t["forced"] for t in shown]
  assert "true" in flags and set(flags) <= {"true", "false"}
  assert "finished: stop" in browser.find_element(By.ID, "gen-stats").text


def test_stop_cancels_and_frees_the_slot(browser, server):
  _open(browser, server)
  _set(browser, "prompt", "1, 2, 3, 4, 5,")  # counts on, greedy
  _set(browser, "max-tokens", 480)
  browser.find_element(By.ID, "gen-start").click()
  _wait(
    browser,
    lambda d: len(d.find_elements(By.CSS_SELECTOR, "#gen-out .tok")) >= 5,
  )
  assert server.metric("vllm:num_requests_running", AUTH) == 1
  before = _cancelled(server)
  browser.find_element(By.ID, "gen-stop").click()
  _wait(browser, lambda d: _state(d, "gen-out") == "cancelled", 10)
  assert "cancelled" in browser.find_element(By.ID, "gen-stats").text
  # The server ended it as cancelled (not as finished) and freed the slot.
  server.wait_for("vllm:num_requests_running", 0, AUTH, timeout=10)
  deadline = time.monotonic() + 10
  while _cancelled(server) != before + 1 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _cancelled(server) == before + 1
  assert not _error(browser)


def test_errors_are_readable(browser, server):
  _open(browser, server)
  _set(browser, "max-tokens", 4)
  _set(browser, "gen-model", "nope")
  browser.find_element(By.ID, "gen-start").click()
  _wait(browser, lambda d: _error(d))
  assert "nope" in _error(browser) and "adapter" in _error(browser)
  assert _state(browser, "gen-out") == "error"
  _set(browser, "gen-model", MODEL)
  Select(browser.find_element(By.ID, "constraint-kind")).select_by_value("json")
  _set(browser, "constraint", '{"type": "object", "properties": ')
  browser.find_element(By.ID, "gen-start").click()
  _wait(browser, lambda d: "schema is not valid JSON:" in _error(d))
  _set(browser, "constraint", '{"type": "nonsense"}')
  browser.find_element(By.ID, "gen-start").click()
  _wait(browser, lambda d: "'nonsense' is not valid" in _error(d))
  # Score mode: an unknown adapter to compare with.
  browser.find_element(By.ID, "tab-score").click()
  _set(browser, "score-model-b", "nope")
  browser.find_element(By.ID, "score-start").click()
  _wait(browser, lambda d: _state(d, "score-out") != "running")
  assert _state(browser, "score-out") == "error"
  assert "nope" in _error(browser)
  assert _state(browser, "gen-out") == "error"


def test_score_equals_prefill_and_compares_the_adapter(
  browser, server, model, shots
):
  text = f"Les élèves aiment le café ☕. {HOSTILE}"
  _open(browser, server)
  browser.find_element(By.ID, "tab-score").click()
  _set(browser, "score-text", text)
  _set(browser, "score-model-b", "tuned")
  browser.find_element(By.ID, "score-start").click()
  _wait(browser, lambda d: _state(d, "score-out") != "running")
  assert _state(browser, "score-out") == "done", _error(browser)
  base = _tokens(browser, '.column[data-model="smollm2-135m"]')
  tuned = _tokens(browser, '.column[data-model="tuned"]')
  assert "".join(t["text"] for t in base) == text  # shown as text
  out = browser.find_element(By.ID, "score-out")
  assert not out.find_elements(By.CSS_SELECTOR, "script, img")
  assert browser.execute_script("return window.pwned") is None
  prompt = [model.bos_id, *model.vocab.encode(text)]
  r = model.prefill(
    cw.Chunk(tokens=np.array([prompt]), lengths=np.array([len(prompt)])),
    top_n=5,
  )
  want = np.asarray(r.per_token_scores)[0, 1 : len(prompt)]
  got = np.array([float(t["logprob"]) for t in base])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  best = np.asarray(r.top_logprobs)[0, 1 : len(prompt), 0]
  np.testing.assert_allclose(
    [t["top"][0]["logprob"] for t in base], best, rtol=0, atol=1e-5
  )
  # The totals, and the five tokens where the adapter differs most.
  summaries = browser.find_elements(By.CSS_SELECTOR, ".summary")
  total = float(summaries[0].get_attribute("data-total"))
  assert total == pytest.approx(float(want.sum()), abs=1e-4)
  shown_ppl = float(summaries[0].text.split("perplexity ")[1])
  assert shown_ppl == pytest.approx(np.exp(-want.sum() / len(want)), 1e-4)
  diffs = np.array([float(t["logprob"]) for t in tuned]) - got
  top5 = set(np.argsort(-np.abs(diffs))[:5].tolist())
  assert {i for i, t in enumerate(base) if t["disagree"]} == top5
  assert {i for i, t in enumerate(tuned) if t["disagree"]} == top5
  items = browser.find_elements(By.CSS_SELECTOR, "#disagree-list li")
  assert len(items) == 5
  items[0].find_element(By.TAG_NAME, "button").click()
  focused = browser.switch_to.active_element
  assert focused.text == base[int(np.argmax(np.abs(diffs)))]["text"]
  assert focused.get_attribute("aria-label").endswith(
    "among the largest differences"
  )
  browser.save_screenshot(str(shots / "explore-score.png"))
  # A narrow window: nothing wider than the screen.
  browser.set_window_size(400, 900)
  try:
    for tab in ("tab-score", "tab-generate"):
      browser.find_element(By.ID, tab).click()
      assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
      )
  finally:
    browser.set_window_size(1280, 1000)
  assert not _csp_violations(browser)
