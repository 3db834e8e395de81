// The chat playground: streams /v1/chat/completions, keeps the conversation in this tab
// (sessionStorage), and shows TTFT and tokens/s under each reply.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const CONVO_STORE = "llmkit.conversation";
  const SETTINGS_STORE = "llmkit.chatSettings";
  const SETTINGS = ["model", "system", "temperature", "top-p", "max-tokens", "seed", "stop"];

  // [{role, content, stats?, error?}] — the system prompt is not stored here; it is sent
  // first from the settings box on every request.
  let conversation = [];
  let controller = null;
  // The served models' cards (/v1/models) by id.
  let cards = new Map();

  // -- settings ----------------------------------------------------------------------------
  // Only the controls the user changed are kept: the others follow the server's defaults.
  function savedSettings() {
    try { return JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}"); } catch (_) { return {}; }
  }

  function loadSettings() {
    const saved = savedSettings();
    for (const id of SETTINGS) if (saved[id] !== undefined && id !== "model") $(id).value = saved[id];
    return saved;
  }

  function saveSetting(id) {
    const values = savedSettings();
    values[id] = $(id).value;
    localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
  }

  // The sliders start where the server starts: a request that leaves temperature / top_p out
  // gets the model's recommended values (its generation_config), which /v1/models lists as
  // each card's `sampling_defaults`. A value the user set (kept in localStorage) wins.
  function applyModelDefaults(card) {
    const defaults = card && card.sampling_defaults;
    if (!defaults) return;
    const saved = savedSettings();
    for (const [id, field] of [["temperature", "temperature"], ["top-p", "top_p"]]) {
      const from = defaults.from_model.includes(field) ? "the model's default" : "the server's default";
      $(id).title = `${from}: ${defaults[field]}`;
      if (saved[id] === undefined) $(id).value = defaults[field];
    }
    showSliderValues();
    document.body.dataset.samplingDefaults = card.id;
  }

  function showSliderValues() {
    $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
    $("top-p-value").textContent = Number($("top-p").value).toFixed(2);
  }

  // HOOK(structured output): returns the request's `response_format` once the JSON-schema box
  // (#structured-output, hidden until the server supports it) is shown and filled in.
  function structuredOutputFormat() {
    const box = $("structured-output");
    const text = $("json-schema").value.trim();
    if (box.hidden || !text) return null;
    return { type: "json_schema", json_schema: { name: "reply", schema: JSON.parse(text) } };
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of conversation) if (!m.error) messages.push({ role: m.role, content: m.content });
    const body = {
      model: $("model").value || undefined,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      top_p: Number($("top-p").value),
    };
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const seed = $("seed").value.trim();
    if (seed !== "") body.seed = parseInt(seed, 10);
    const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
    if (stop.length) body.stop = stop;
    const format = structuredOutputFormat();
    if (format) body.response_format = format;
    return body;
  }

  // -- models ------------------------------------------------------------------------------
  async function loadModels(preferred) {
    const select = $("model");
    try {
      const resp = await fetch("/v1/models", { headers: llmkit.headers() });
      if (!resp.ok) {
        llmkit.setStatus(resp.status === 401 ? "API key needed (settings)" : await llmkit.errorMessage(resp), "bad");
        return;
      }
      const models = (await resp.json()).data || [];
      cards = new Map(models.map((m) => [m.id, m]));
      select.replaceChildren();
      for (const m of models) {
        const opt = document.createElement("option");
        opt.value = m.id;
        // LoRA adapters are listed with their base model as `parent`.
        opt.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
        select.appendChild(opt);
      }
      if (preferred && models.some((m) => m.id === preferred)) select.value = preferred;
      applyModelDefaults(cards.get(select.value));
      llmkit.setStatus(`connected · ${models.length} model${models.length === 1 ? "" : "s"}`, "good");
    } catch (e) {
      llmkit.setStatus("server unreachable", "bad");
    }
  }

  // -- rendering ---------------------------------------------------------------------------
  function messageElement(m) {
    const el = document.createElement("div");
    el.className = "msg " + (m.error ? "error" : m.role);
    el.dataset.role = m.role;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = m.role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    body.textContent = m.content;
    el.append(who, body);
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.dataset.testid = "reply-stats";
    stats.textContent = m.stats || "";
    if (m.role === "assistant") el.append(stats);
    return el;
  }

  function render() {
    const box = $("messages");
    box.replaceChildren();
    if (!conversation.length) {
      const p = document.createElement("p");
      p.className = "empty";
      p.textContent = "Ask something to start.";
      box.append(p);
    }
    for (const m of conversation) box.append(messageElement(m));
    box.scrollTop = box.scrollHeight;
  }

  function saveConversation() {
    sessionStorage.setItem(CONVO_STORE, JSON.stringify(conversation));
  }

  function formatStats(s) {
    const parts = [];
    if (s.ttftMs !== null) parts.push(`TTFT ${s.ttftMs.toFixed(0)} ms`);
    if (s.tokensPerS !== null) parts.push(`${s.tokensPerS.toFixed(1)} tok/s`);
    if (s.tokens !== null) parts.push(`${s.tokens} tokens`);
    if (s.finish) parts.push(`finish: ${s.finish}`);
    return parts.join(" · ");
  }

  // -- sending -----------------------------------------------------------------------------
  async function send(text) {
    conversation.push({ role: "user", content: text });
    const body = JSON.stringify(requestBody()); // before the reply's placeholder joins it
    const reply = { role: "assistant", content: "", stats: "" };
    conversation.push(reply);
    render();
    const el = $("messages").lastElementChild;
    const bodyEl = el.querySelector(".body");
    const statsEl = el.querySelector(".stats");
    const stats = { ttftMs: null, tokensPerS: null, tokens: null, finish: null };
    setBusy(true);
    controller = new AbortController();
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: llmkit.headers({ "Content-Type": "application/json" }),
        body,
        signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await llmkit.errorMessage(resp));
      await llmkit.readEvents(resp, (_name, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            const now = performance.now();
            if (tFirst === null) {
              tFirst = now;
              stats.ttftMs = now - t0;
            }
            tLast = now;
            reply.content += piece;
            bodyEl.textContent = reply.content;
            $("messages").scrollTop = $("messages").scrollHeight;
          }
          if (choice.finish_reason) stats.finish = choice.finish_reason;
        }
        reply.stats = formatStats(stats);
        statsEl.textContent = reply.stats;
      });
    } catch (e) {
      if (e.name === "AbortError") {
        stats.finish = "stopped";
      } else {
        reply.error = true;
        reply.content = reply.content ? `${reply.content}\n\n[error] ${e.message}` : `[error] ${e.message}`;
      }
    } finally {
      if (tFirst !== null && tLast > tFirst && stats.tokens > 1) {
        stats.tokensPerS = (stats.tokens - 1) / ((tLast - tFirst) / 1000);
      }
      reply.stats = formatStats(stats);
      controller = null;
      setBusy(false);
      render();
      saveConversation();
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop-reply").disabled = !busy;
    document.body.dataset.busy = busy ? "1" : "";
  }

  // -- wiring ------------------------------------------------------------------------------
  function init() {
    const saved = loadSettings();
    showSliderValues();
    try { conversation = JSON.parse(sessionStorage.getItem(CONVO_STORE) || "[]"); } catch (_) { }
    render();
    llmkit.bindApiKeyField($("api-key"), () => loadModels($("model").value));
    for (const id of SETTINGS) $(id).addEventListener("change", () => saveSetting(id));
    $("model").addEventListener("change", () => applyModelDefaults(cards.get($("model").value)));
    $("temperature").addEventListener("input", showSliderValues);
    $("top-p").addEventListener("input", showSliderValues);
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) {
        ev.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop-reply").addEventListener("click", () => controller && controller.abort());
    $("new-chat").addEventListener("click", () => {
      if (controller) controller.abort();
      conversation = [];
      saveConversation();
      render();
    });
    loadModels(saved.model);
  }

  init();
})();
