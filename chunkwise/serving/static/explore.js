// chunkwise token explorer (chunkwise/serving/explore.py).
//
// Talks to the server it was loaded from, as any client does: TGI's
// /generate_stream for a prompt, OpenAI's /v1/chat/completions for chat
// messages, /v1/completions (echo + logprobs) to score a text, /v1/models
// and /info for its choices. The API key typed in is sent with each
// request and kept nowhere else. Model output is written with textContent
// only: a token that reads "<script>" is shown as those characters.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const LOW = 0.1; // below this probability a token is underlined
  const DISAGREE = 5; // tokens highlighted where two models differ most
  const state = { controller: null, base: null, maxTopN: 0, connects: 0 };

  function el(tag, className, text) {
    const e = document.createElement(tag);
    if (className) e.className = className;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // -- talking to the server ------------------------------------------------

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = $("key").value;
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  // An error response's message, in either API's shape.
  async function errorOf(response) {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      if (body.error && typeof body.error === "object") {
        if (body.error.message) return body.error.message;
      }
      if (typeof body.error === "string" && body.error) return body.error;
    } catch (e) {
      // not JSON: shown as it came
    }
    return `HTTP ${response.status} ${response.statusText}: ${text.slice(0, 300)}`;
  }

  async function call(path, body, signal) {
    const response = await fetch(path, {
      method: body === undefined ? "GET" : "POST",
      headers: headers(),
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      signal,
    });
    if (!response.ok) throw new Error(await errorOf(response));
    return response;
  }

  // An event block's payload: its `data:` lines joined (null: none).
  function payload(block) {
    const lines = block
      .split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5));
    return lines.length ? lines.join("\n") : null;
  }

  // Server-sent events: each event's data, parsed; stops at [DONE]. The
  // response is cancelled whenever the reader stops early.
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += decoder.decode(value, { stream: !done }).replace(/\r\n?/g, "\n");
        const blocks = buffer.split("\n\n");
        buffer = done ? "" : blocks.pop();
        for (const block of blocks) {
          const data = payload(block);
          if (data === null) continue;
          if (data.trim() === "[DONE]") return;
          yield JSON.parse(data);
        }
        if (done) return;
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = !message;
  }

  // -- tokens ---------------------------------------------------------------

  const pct = (p) =>
    p >= 0.001 || p === 0 ? `${(100 * p).toFixed(1)}%` : `${p.toExponential(1)}`;
  const shown = (text) => JSON.stringify(text);

  // One token element: t = {id?, text, logprob, top: [{id?, text, logprob}],
  // forced?, special?}. Its numbers travel in data- attributes.
  function tokenElement(t) {
    const span = el("span", "tok", t.text);
    span.setAttribute("role", "listitem");
    span.tabIndex = -1; // one tab stop per list: arrows move within it
    const known = typeof t.logprob === "number";
    const p = known ? Math.exp(t.logprob) : 1;
    span.style.setProperty("--p", String(p));
    span.dataset.logprob = known ? String(t.logprob) : "";
    if (t.id !== undefined && t.id !== null) span.dataset.id = String(t.id);
    span.dataset.top = JSON.stringify(t.top || []);
    if (t.forced !== undefined && t.forced !== null) {
      span.dataset.forced = String(t.forced);
      if (t.forced) span.classList.add("forced");
    }
    if (t.special) span.classList.add("special");
    if (!known) span.classList.add("prompt-first");
    else if (p < LOW) span.classList.add("low");
    let label = `${shown(t.text)}: `;
    label += known ? `probability ${pct(p)}` : "no probability (first token)";
    if (t.forced) label += ", forced by the constraint";
    if (t.diff !== undefined) label += `; ${t.diff}`;
    span.setAttribute("aria-label", label);
    span.token = t;
    span.addEventListener("mouseenter", () => showCard(span, t));
    span.addEventListener("focus", () => {
      for (const other of span.parentElement.querySelectorAll(".tok")) {
        other.tabIndex = other === span ? 0 : -1;
      }
      showCard(span, t);
    });
    span.addEventListener("mouseleave", () => {
      const focused = document.activeElement;
      if (focused && focused.token) showCard(focused, focused.token);
      else hideCard();
    });
    span.addEventListener("blur", hideCard);
    span.addEventListener("keydown", moveFocus);
    return span;
  }

  // Appends a token element; the list's first token is its tab stop.
  function appendToken(list, t) {
    const span = tokenElement(t);
    if (!list.querySelector(".tok")) span.tabIndex = 0;
    list.append(span);
    return span;
  }

  // Arrow keys, Home and End move between a list's tokens.
  function moveFocus(e) {
    const span = e.currentTarget;
    const all = Array.from(span.parentElement.querySelectorAll(".tok"));
    const i = all.indexOf(span);
    const to = {
      ArrowRight: i + 1,
      ArrowDown: i + 1,
      ArrowLeft: i - 1,
      ArrowUp: i - 1,
      Home: 0,
      End: all.length - 1,
    }[e.key];
    if (to === undefined) return;
    e.preventDefault();
    if (to >= 0 && to < all.length) all[to].focus();
  }

  function showCard(anchor, t) {
    const card = $("card");
    card.replaceChildren();
    card.append(el("div", "what", shown(t.text)));
    const facts = [];
    if (typeof t.logprob === "number") {
      facts.push(`probability ${pct(Math.exp(t.logprob))}`);
      facts.push(`log-prob ${t.logprob.toFixed(4)}`);
    } else {
      facts.push("the first token: nothing before it to predict it");
    }
    if (t.id !== undefined && t.id !== null) facts.push(`id ${t.id}`);
    if (t.forced) facts.push("forced by the constraint (the only token allowed)");
    else if (t.forced === false) facts.push("allowed by the constraint");
    if (t.diff !== undefined) facts.push(`${t.diff}`);
    card.append(el("div", "facts", facts.join(" · ")));
    if (t.top && t.top.length) {
      const table = el("table");
      const caption = el("caption", "muted", "Most likely here");
      table.append(caption);
      for (const alt of t.top) {
        const row = el("tr");
        const ap = Math.exp(alt.logprob);
        if (alt.text === t.text && (alt.id === undefined || alt.id === t.id)) {
          row.className = "chosen";
        }
        const bar = el("div", "bar");
        bar.style.setProperty("--p", String(ap));
        const barCell = el("td", "bar-cell");
        barCell.append(bar);
        row.append(
          el("td", "text", shown(alt.text)),
          el("td", "", pct(ap)),
          el("td", "", alt.logprob.toFixed(3)),
          barCell,
        );
        table.append(row);
      }
      card.append(table);
    }
    card.hidden = false;
    for (const other of document.querySelectorAll("[aria-describedby=card]")) {
      other.removeAttribute("aria-describedby");
    }
    anchor.setAttribute("aria-describedby", "card");
    const box = anchor.getBoundingClientRect();
    const room = document.documentElement.clientWidth - card.offsetWidth - 4;
    card.style.left = `${window.scrollX + Math.max(4, Math.min(box.left, room))}px`;
    card.style.top = `${window.scrollY + box.bottom + 6}px`;
  }

  function hideCard() {
    $("card").hidden = true;
  }

  // -- models and limits ----------------------------------------------------

  async function connect() {
    const attempt = ++state.connects; // a later attempt's answer wins
    showError("");
    try {
      const models = await (await call("v1/models")).json();
      const info = await (await call("info")).json();
      if (attempt !== state.connects) return;
      const list = $("models");
      list.replaceChildren();
      for (const m of models.data) {
        const option = el("option");
        option.value = m.id;
        list.append(option);
      }
      state.base = info.model_id;
      state.maxTopN = info.max_top_n_tokens || 0;
      for (const id of ["gen-model", "score-model-a"]) {
        if (!$(id).value) $(id).value = info.model_id;
      }
      for (const id of ["gen-top-n", "score-top-n"]) {
        $(id).max = String(state.maxTopN);
        if (Number($(id).value) > state.maxTopN) $(id).value = String(state.maxTopN);
      }
      const adapters = models.data.length - 1;
      $("server").textContent =
        `${info.model_id} · ${adapters} adapter${adapters === 1 ? "" : "s"} · ` +
        `${info.slots} slots · up to ${state.maxTopN} alternatives`;
    } catch (e) {
      if (attempt !== state.connects) return;
      $("server").textContent = "";
      showError(`Could not reach the server: ${e.message}`);
    }
  }

  // -- generate -------------------------------------------------------------

  function number(id, fallback) {
    const v = $(id).value.trim();
    if (v === "") return fallback;
    const n = Number(v);
    if (!Number.isFinite(n)) throw new Error(`${id}: ${shown(v)} is not a number`);
    return n;
  }

  function constraint() {
    const kind = $("constraint-kind").value;
    const value = $("constraint").value;
    if (!kind) return null;
    if (kind === "regex") return { kind, value };
    try {
      return { kind, value: JSON.parse(value) };
    } catch (e) {
      throw new Error(`The JSON schema is not valid JSON: ${e.message}`);
    }
  }

  function messages() {
    return Array.from($("message-list").children).map((li) => ({
      role: li.querySelector("select").value,
      content: li.querySelector("textarea").value,
    }));
  }

  function addMessage(role, content) {
    const li = el("li");
    const select = el("select");
    select.setAttribute("aria-label", "Role");
    for (const r of ["system", "user", "assistant"]) {
      const option = el("option", "", r);
      option.value = r;
      select.append(option);
    }
    select.value = role;
    const text = el("textarea");
    text.rows = 2;
    text.value = content;
    text.setAttribute("aria-label", "Message");
    const remove = el("button", "", "Remove");
    remove.type = "button";
    remove.addEventListener("click", () => li.remove());
    li.append(select, remove, text);
    $("message-list").append(li);
  }

  // The request for the chosen mode: [path, body, reader of one event].
  function generationRequest() {
    const chat = document.querySelector('input[name="gen-mode"]:checked').value === "chat";
    const model = $("gen-model").value.trim() || state.base;
    if (!model) throw new Error("Choose a model first (Connect lists them).");
    const temperature = number("temperature", 0);
    const topP = number("top-p", 1);
    const topK = number("top-k", 0);
    const seed = number("seed", null);
    const topN = number("gen-top-n", 0);
    const maxTokens = number("max-tokens", 48);
    const c = constraint();
    if (chat) {
      const body = {
        model,
        messages: messages(),
        max_tokens: maxTokens,
        temperature,
        top_p: topP,
        stream: true,
        logprobs: true,
        top_logprobs: topN,
      };
      if (topK > 0) body.top_k = topK;
      if (seed !== null) body.seed = seed;
      if (c && c.kind === "json") {
        body.response_format = {
          type: "json_schema",
          json_schema: { name: "schema", schema: c.value },
        };
      } else if (c) {
        body.guided_regex = c.value;
      }
      return ["v1/chat/completions", body, chatTokens];
    }
    const parameters = {
      max_new_tokens: maxTokens,
      details: true,
      top_n_tokens: topN,
      do_sample: temperature > 0,
      temperature: temperature > 0 ? temperature : null,
    };
    if (temperature > 0 && topP < 1) parameters.top_p = topP;
    if (temperature > 0 && topK > 0) parameters.top_k = topK;
    if (seed !== null) parameters.seed = seed;
    if (model !== state.base) parameters.adapter_id = model;
    if (c) parameters.grammar = { type: c.kind, value: c.value };
    return ["generate_stream", { inputs: $("prompt").value, parameters }, nativeTokens];
  }

  // A TGI event: [tokens, finish reason or null].
  function nativeTokens(event) {
    if (event.error) throw new Error(event.error);
    const t = event.token;
    const top = (event.top_tokens || []).map((a) => ({
      id: a.id,
      text: a.text,
      logprob: a.logprob,
    }));
    const token = { ...t, top };
    return [[token], event.details ? event.details.finish_reason : null];
  }

  // An OpenAI chat chunk: [tokens, finish reason or null].
  function chatTokens(chunk) {
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = (chunk.choices || [])[0];
    if (!choice) return [[], null];
    const content = (choice.logprobs && choice.logprobs.content) || [];
    const tokens = content.map((e) => ({
      text: e.token,
      logprob: e.logprob,
      forced: e.forced,
      top: (e.top_logprobs || []).map((a) => ({ text: a.token, logprob: a.logprob })),
    }));
    return [tokens, choice.finish_reason];
  }

  function stats(start, first, last, count, reason) {
    const parts = [`${count} token${count === 1 ? "" : "s"}`];
    if (first !== null) parts.push(`time to first token ${((first - start) / 1000).toFixed(2)} s`);
    if (count > 1 && last > first) {
      parts.push(`${((1000 * (count - 1)) / (last - first)).toFixed(1)} tokens/s`);
    }
    if (reason) parts.push(`finished: ${reason}`);
    $("gen-stats").textContent = parts.join(" · ");
  }

  // What a screen reader hears: the start and the end, not every token.
  function announce(message) {
    $("announce").textContent = message;
  }

  async function generate(event) {
    event.preventDefault();
    showError("");
    hideCard();
    const out = $("gen-out");
    let request;
    try {
      request = generationRequest();
    } catch (e) {
      showError(e.message);
      return;
    }
    const [path, body, read] = request;
    out.replaceChildren();
    out.dataset.state = "running";
    out.setAttribute("aria-busy", "true");
    announce("Generating");
    $("gen-start").disabled = true;
    $("gen-stop").disabled = false;
    const controller = new AbortController();
    state.controller = controller;
    const start = performance.now();
    let first = null;
    let last = null;
    let count = 0;
    let reason = null;
    stats(start, first, last, count, reason);
    try {
      const response = await call(path, body, controller.signal);
      for await (const e of events(response)) {
        const [tokens, finish] = read(e);
        for (const t of tokens) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          count += 1;
          appendToken(out, t);
        }
        if (finish) reason = finish;
        stats(start, first, last, count, reason);
      }
      out.dataset.state = "done";
    } catch (e) {
      if (controller.signal.aborted) {
        reason = "cancelled";
        out.dataset.state = "cancelled";
      } else {
        showError(e.message);
        out.dataset.state = "error";
      }
    } finally {
      controller.abort(); // frees the server's slot if reading failed
      state.controller = null;
      $("gen-start").disabled = false;
      $("gen-stop").disabled = true;
      out.removeAttribute("aria-busy");
      stats(start, first, last, count, reason);
      announce($("gen-stats").textContent);
    }
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // -- score ----------------------------------------------------------------

  async function scoreWith(model, text, topN) {
    const response = await call("v1/completions", {
      model,
      prompt: text,
      max_tokens: 0,
      echo: true,
      logprobs: topN,
    });
    const lp = (await response.json()).choices[0].logprobs;
    return lp.tokens.map((token, i) => ({
      text: token,
      logprob: lp.token_logprobs[i],
      top: Object.entries((lp.top_logprobs || [])[i] || {})
        .map(([alt, logprob]) => ({ text: alt, logprob }))
        .sort((a, b) => b.logprob - a.logprob),
    }));
  }

  function column(model, tokens) {
    const scored = tokens.filter((t) => typeof t.logprob === "number");
    const total = scored.reduce((s, t) => s + t.logprob, 0);
    const div = el("div", "column");
    div.dataset.model = model;
    div.append(el("h2", "", model));
    const summary = el(
      "p",
      "summary",
      `${tokens.length} tokens · log-likelihood ${total.toFixed(3)} · ` +
        `perplexity ${Math.exp(-total / Math.max(1, scored.length)).toFixed(3)}`,
    );
    summary.dataset.total = String(total);
    div.append(summary);
    const box = el("div", "tokens");
    box.setAttribute("role", "list");
    box.setAttribute("aria-label", `Tokens of the text under ${model}`);
    for (const t of tokens) appendToken(box, t);
    div.append(box);
    return div;
  }

  async function score(event) {
    event.preventDefault();
    showError("");
    hideCard();
    const out = $("score-out");
    const text = $("score-text").value;
    const a = $("score-model-a").value.trim() || state.base || "";
    const b = $("score-model-b").value.trim();
    $("disagree").hidden = true;
    out.replaceChildren();
    $("score-stats").textContent = "";
    out.dataset.state = "running";
    $("score-start").disabled = true;
    try {
      if (!text) throw new Error("Nothing to score: the text is empty.");
      if (!a) throw new Error("Choose a model first (Connect lists them).");
      const topN = number("score-top-n", 0);
      const [ta, tb] = await Promise.all([
        scoreWith(a, text, topN),
        b ? scoreWith(b, text, topN) : null,
      ]);
      if (tb) compare(ta, tb, a, b);
      out.replaceChildren(column(a, ta), ...(tb ? [column(b, tb)] : []));
      if (tb) markDisagreements(out, ta, tb);
      $("score-stats").textContent = `${ta.length} tokens scored`;
      out.dataset.state = "done";
    } catch (e) {
      showError(e.message);
      out.dataset.state = "error";
    } finally {
      $("score-start").disabled = false;
    }
  }

  // Writes each token's difference (b minus a) into both lists.
  function compare(ta, tb, a, b) {
    if (ta.length !== tb.length || ta.some((t, i) => t.text !== tb[i].text)) {
      throw new Error(`${a} and ${b} split the text into different tokens`);
    }
    ta.forEach((t, i) => {
      if (typeof t.logprob !== "number") return;
      const d = tb[i].logprob - t.logprob;
      const line = `${b} − ${a}: ${d >= 0 ? "+" : ""}${d.toFixed(3)} nats`;
      t.diff = line;
      tb[i].diff = line;
    });
  }

  function markDisagreements(out, ta, tb) {
    const order = ta
      .map((t, i) => [i, typeof t.logprob === "number" ? Math.abs(tb[i].logprob - t.logprob) : -1])
      .filter(([, d]) => d > 0)
      .sort((x, y) => y[1] - x[1])
      .slice(0, DISAGREE);
    const columns = out.querySelectorAll(".column .tokens");
    const list = $("disagree-list");
    list.replaceChildren();
    for (const [i, d] of order) {
      for (const c of columns) {
        const span = c.children[i];
        span.classList.add("disagree");
        const label = span.getAttribute("aria-label");
        span.setAttribute("aria-label", `${label}, among the largest differences`);
        span.dataset.diff = String(tb[i].logprob - ta[i].logprob);
      }
      const item = el("li");
      const button = el(
        "button",
        "",
        `${shown(ta[i].text)} (token ${i}): ${d.toFixed(3)} nats apart`,
      );
      button.type = "button";
      button.addEventListener("click", () => columns[0].children[i].focus());
      item.append(button);
      list.append(item);
    }
    $("disagree").hidden = order.length === 0;
  }

  // -- tabs and wiring ------------------------------------------------------

  function selectTab(tab) {
    for (const t of document.querySelectorAll('[role="tab"]')) {
      const selected = t === tab;
      t.setAttribute("aria-selected", String(selected));
      t.tabIndex = selected ? 0 : -1;
      $(t.getAttribute("aria-controls")).hidden = !selected;
    }
    hideCard();
  }

  function init() {
    const tabs = Array.from(document.querySelectorAll('[role="tab"]'));
    for (const tab of tabs) {
      tab.addEventListener("click", () => selectTab(tab));
      tab.addEventListener("keydown", (e) => {
        if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return;
        const next = tabs[(tabs.indexOf(tab) + (e.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length];
        selectTab(next);
        next.focus();
      });
    }
    for (const radio of document.querySelectorAll('input[name="gen-mode"]')) {
      radio.addEventListener("change", () => {
        const chat = radio.value === "chat" && radio.checked;
        $("messages").hidden = !chat;
        $("prompt").hidden = chat;
        document.querySelector('label[for="prompt"]').hidden = chat;
      });
    }
    addMessage("user", "Name three colours.");
    $("add-message").addEventListener("click", () => addMessage("user", ""));
    $("gen-form").addEventListener("submit", generate);
    $("gen-stop").addEventListener("click", stop);
    $("score-form").addEventListener("submit", score);
    $("connect").addEventListener("click", connect);
    $("key").addEventListener("keydown", (e) => {
      if (e.key === "Enter") connect();
    });
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape") hideCard();
    });
    connect();
  }

  init();
})();
