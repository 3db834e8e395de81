// The live engine view: loads /v1/engine/stats, then follows /v1/engine/events (reconnecting
// with back-off), and draws the cards, the per-step chart and the requests table.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const MAX_BARS = 120;
  let history = []; // step summaries (those with tokens), oldest first
  let latest = null;
  let blockTotal = null;
  let rateWindow = []; // [time_s, step, total_scheduled_tokens]
  let retryMs = 500;
  let streamAbort = null;

  function fmt(n) { return n === null || n === undefined ? "–" : String(n); }

  function update(s) {
    latest = s;
    if (s.num_scheduled_tokens > 0) {
      history.push(s);
      if (history.length > MAX_BARS) history.splice(0, history.length - MAX_BARS);
    }
    rateWindow.push([s.time, s.step, s.total_scheduled_tokens || 0]);
    while (rateWindow.length > 2 && s.time - rateWindow[0][0] > 5) rateWindow.shift();
    renderCards(s);
    renderRequests(s);
    drawChart();
  }

  function renderCards(s) {
    $("running").textContent = fmt(s.num_running);
    $("waiting").textContent = fmt(s.num_waiting);
    const total = s.num_blocks || blockTotal;
    $("held").textContent = fmt(s.num_held_blocks);
    $("held-sub").textContent = `of ${fmt(total)} blocks · ${fmt(s.num_free_blocks)} free`;
    $("held-bar").style.width = total ? `${(100 * s.num_held_blocks / total).toFixed(1)}%` : "0";
    const groups = Object.entries(s.kv_usage_by_group || {});
    $("held-groups").textContent = groups.length > 1
      ? groups.map(([g, u]) => `${g} ${(100 * u).toFixed(1)}%`).join(" · ") : "";
    $("cached").textContent = fmt(s.num_cached_blocks);
    const q = s.prefix_cache_queries || 0;
    $("hit-rate").textContent = q ? `${(100 * s.prefix_cache_hits / q).toFixed(1)}%` : "–";
    $("hit-sub").textContent = `${fmt(s.prefix_cache_hits)} of ${fmt(q)} tokens, since start-up`;
    $("preemptions").textContent = fmt(s.num_preemptions_total);
    $("steps").textContent = fmt(s.step);
    if (rateWindow.length >= 2) {
      const [t0, st0, tok0] = rateWindow[0];
      const [t1, st1, tok1] = rateWindow[rateWindow.length - 1];
      const dt = t1 - t0;
      if (dt > 0) {
        $("step-rate").textContent = `${((st1 - st0) / dt).toFixed(1)} steps/s (last 5 s)`;
        $("token-rate").textContent = ((tok1 - tok0) / dt).toFixed(0);
      }
    }
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    return td;
  }

  function renderRequests(s) {
    const body = $("requests");
    body.replaceChildren();
    const total = s.num_blocks || blockTotal || 1;
    const maxHeld = Math.max(1, ...s.requests.map((r) => r.num_blocks));
    for (const r of s.requests) {
      const tr = document.createElement("tr");
      tr.dataset.status = r.status;
      tr.append(cell(r.request_id, "mono"));
      const state = document.createElement("td");
      const tag = document.createElement("span");
      tag.className = `tag ${r.status}`;
      tag.textContent = r.status;
      state.append(tag);
      tr.append(state, cell(r.num_prompt_tokens), cell(r.num_computed_tokens),
                cell(r.num_output_tokens));
      const blocks = cell(`${r.num_blocks}`);
      const bar = document.createElement("div");
      bar.className = "bar";
      const fill = document.createElement("div");
      fill.style.width = `${(100 * r.num_blocks / Math.max(maxHeld, total / 8)).toFixed(1)}%`;
      bar.append(fill);
      blocks.append(bar);
      tr.append(blocks);
      body.append(tr);
    }
    if (!s.requests.length) {
      const tr = document.createElement("tr");
      const td = cell("no requests in the engine");
      td.colSpan = 6;
      td.className = "hint";
      tr.append(td);
      body.append(tr);
    }
    $("omitted").textContent = s.num_requests_omitted ? `(+${s.num_requests_omitted} not listed)` : "";
  }

  function drawChart() {
    const canvas = $("steps-chart");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.clearRect(0, 0, w, h);
    const css = getComputedStyle(document.documentElement);
    const colors = { prefill: css.getPropertyValue("--prefill").trim(),
                     decode: css.getPropertyValue("--decode").trim(),
                     muted: css.getPropertyValue("--muted").trim(),
                     line: css.getPropertyValue("--line").trim() };
    const left = 44, bottom = 18, top = 8;
    const plotH = h - bottom - top;
    const maxTok = Math.max(1, ...history.map((s) => s.num_prefill_tokens + s.num_decode_tokens));
    ctx.strokeStyle = colors.line;
    ctx.fillStyle = colors.muted;
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    for (const frac of [0, 0.5, 1]) {
      const y = top + plotH * (1 - frac);
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w, y); ctx.stroke();
      ctx.fillText(String(Math.round(maxTok * frac)), left - 6, y + 4);
    }
    const slot = (w - left) / MAX_BARS;
    const barW = Math.max(1, slot * 0.8);
    history.forEach((s, i) => {
      const x = left + i * slot;
      const hp = plotH * s.num_prefill_tokens / maxTok;
      const hd = plotH * s.num_decode_tokens / maxTok;
      ctx.fillStyle = colors.decode;
      ctx.fillRect(x, top + plotH - hd, barW, hd);
      ctx.fillStyle = colors.prefill;
      ctx.fillRect(x, top + plotH - hd - hp, barW, hp);
    });
    ctx.fillStyle = colors.muted;
    ctx.textAlign = "left";
    if (history.length) {
      ctx.fillText(`step ${history[0].step}`, left, h - 4);
      ctx.textAlign = "right";
      ctx.fillText(`step ${history[history.length - 1].step}`, w, h - 4);
    } else {
      ctx.fillText("no steps yet", left + 8, top + plotH / 2);
    }
    const skipped = history.reduce((n, s) => n + (s.steps_skipped || 0), 0);
    $("chart-note").textContent = history.length
      ? `${history.length} steps drawn, ${skipped} in between not drawn` : "";
  }

  // -- data --------------------------------------------------------------------------------
  async function loadStats() {
    const resp = await fetch(`/v1/engine/stats?history=${MAX_BARS}`, { headers: llmkit.headers() });
    if (!resp.ok) throw new Error(resp.status === 401 ? "API key needed (below)" : await llmkit.errorMessage(resp));
    const stats = await resp.json();
    blockTotal = stats.engine.num_blocks;
    $("events-per-s").textContent = fmt(stats.engine.events_per_s);
    history = [];
    for (const s of stats.recent) if (s.num_scheduled_tokens > 0) history.push(s);
    if (stats.latest) update(stats.latest);
    else drawChart();
    return stats.engine;
  }

  async function follow() {
    streamAbort = new AbortController();
    const resp = await fetch("/v1/engine/events", { headers: llmkit.headers(), signal: streamAbort.signal });
    if (!resp.ok) throw new Error(await llmkit.errorMessage(resp));
    llmkit.setStatus("live", "good");
    retryMs = 500;
    let engineError = null;
    await llmkit.readEvents(resp, (name, data) => {
      if (name === "step") update(JSON.parse(data));
      else if (name === "error") engineError = JSON.parse(data).error.message;
    });
    if (engineError) throw new Error(engineError);
    throw new Error("stream ended");
  }

  async function run() {
    for (;;) {
      try {
        const engine = await loadStats();
        if (!engine.up) throw new Error(engine.restarting ? "engine restarting" : "engine down");
        await follow();
      } catch (e) {
        if (e.name === "AbortError") continue;
        llmkit.setStatus(`${e.message} · retrying`, "bad");
        await new Promise((r) => setTimeout(r, retryMs));
        retryMs = Math.min(retryMs * 2, 10000);
      }
    }
  }

  llmkit.bindApiKeyField($("api-key"), () => { if (streamAbort) streamAbort.abort(); });
  window.addEventListener("resize", drawChart);
  run();
})();
