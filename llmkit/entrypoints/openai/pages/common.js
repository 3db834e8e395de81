// Shared by llmkit's pages: the API key (kept in localStorage), authorized fetches, and a
// reader for server-sent events over fetch (EventSource cannot send an Authorization header).
"use strict";

const llmkit = (() => {
  const KEY_STORE = "llmkit.apiKey";

  function apiKey() {
    return localStorage.getItem(KEY_STORE) || "";
  }

  function setApiKey(value) {
    if (value) localStorage.setItem(KEY_STORE, value);
    else localStorage.removeItem(KEY_STORE);
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // The message of an OpenAI error body, else the HTTP status.
  async function errorMessage(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
    } catch (_) { /* not JSON */ }
    return `HTTP ${resp.status}`;
  }

  // Calls onEvent(name, data) for each event of a text/event-stream response body ("message"
  // when the event has no name); resolves when the stream ends.
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  }

  function setStatus(text, kind) {
    const el = document.getElementById("status");
    if (!el) return;
    el.textContent = text;
    el.className = "status" + (kind ? " " + kind : "");
  }

  function bindApiKeyField(input, onChange) {
    input.value = apiKey();
    input.addEventListener("change", () => {
      setApiKey(input.value.trim());
      if (onChange) onChange();
    });
  }

  return { apiKey, setApiKey, headers, errorMessage, readEvents, setStatus, bindApiKeyField };
})();
