// The playground: one chat request streamed with return_commit_steps and return_anchors, each block replayed in the
// order its tokens were committed. Everything it shows comes from the server's answer and its /metrics.
"use strict";
const S = JSON.parse(document.getElementById("settings").textContent);
const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

function option(select, value, label) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = label;
  select.appendChild(o);
}

function init() {
  $("model").textContent = S.model;
  $("affix").value = S.example ? S.example.affix : "";
  $("question").value = S.example ? S.example.question : "";
  const techniques = [["none", "none: exact (recompute everything)"], ["anchors", "ACache: shared copy + anchors"],
    ["naive", "naive: shared copy as is"]];
  if (S.shallow_depths.length) techniques.push(["shallow", "BiCache: shared copy in the shallow layers"]);
  for (const [v, l] of techniques) option($("technique"), v, l);
  $("technique").value = S.example ? "anchors" : S.affix_technique;
  $("ratio").value = S.anchor_ratio;
  for (const d of S.shallow_depths) option($("depth"), d, d === 0 ? "0 (exact)" : `${d} layers`);
  if (S.shallow_depths.some((d) => d > 0)) option($("depth"), "auto", "auto (calibrated per affix)");
  if (S.shallow_depths.length) $("depth").value = S.shallow_depth ?? S.shallow_depths[0];
  for (const b of S.block_lengths) option($("block-length"), b, b);
  $("block-length").value = S.block_length;
  $("max-tokens").value = S.max_tokens;
  $("steps").value = Math.max(1, Math.round(S.block_length * S.steps_per_token));
  $("temperature").value = S.temperature;
  $("key-box").hidden = !S.api_key;
  const sync = () => {
    $("ratio-box").hidden = $("technique").value !== "anchors";
    $("depth-box").hidden = $("technique").value !== "shallow";
    $("steps-box").hidden = $("rule").value !== "steps";
    $("threshold-box").hidden = $("rule").value !== "threshold";
  };
  for (const id of ["technique", "rule"]) $(id).addEventListener("change", sync);
  sync();
  $("form").addEventListener("submit", (e) => { e.preventDefault(); run(); });
  poll();
}

function body() {
  const affix = $("affix").value.trim(), question = $("question").value.trim();
  const content = !affix ? question : $("placement").value === "prefix" ? `${affix} ${question}` : `${question} ${affix}`;
  const maxTokens = Number($("max-tokens").value), block = Number($("block-length").value);
  const b = {
    model: S.model, stream: true, return_commit_steps: true, return_anchors: true,
    messages: [{ role: "user", content }], max_tokens: maxTokens, block_length: block,
    temperature: Number($("temperature").value), affix: affix ? { text: affix } : "auto",
    affix_technique: $("technique").value,
  };
  const ratio = $("ratio").value.trim();
  if (b.affix_technique === "anchors") b.anchor_ratio = ratio === "auto" ? "auto" : Number(ratio);
  const depth = $("depth").value;
  if (b.affix_technique === "shallow") b.shallow_depth = depth === "auto" ? "auto" : Number(depth);
  if ($("rule").value === "threshold") b.threshold = Number($("threshold").value);
  else b.steps = Math.min(Number($("steps").value), block) * Math.ceil(maxTokens / block);  // at most one a token
  return b;
}

function status(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
}

function tok(text, cls) {
  const t = document.createElement("span");
  t.className = "tok " + cls;
  t.textContent = text === "" ? "␀" : text;
  return t;
}

function showPrompt(trace) {
  const box = $("prompt");
  box.replaceChildren();
  const [start, end] = trace.affix_span || [-1, -1];
  const anchors = new Set(trace.anchors || []);
  trace.prompt_tokens.forEach((text, i) => {
    const cls = (i >= start && i < end ? "affix" : "") + (anchors.has(i) ? " anchor" : "");
    const t = tok(text, cls);
    t.title = `prompt token ${i}` + (anchors.has(i) ? ": an anchor, recomputed for this request" : "");
    box.appendChild(t);
  });
}

// Blocks are replayed one after another: each token appears at the step that committed it.
let replaying = Promise.resolve();

function showBlock(block, previous) {
  const row = document.createElement("div");
  row.className = "block-row";
  row.dataset.block = block.block;
  const meta = document.createElement("span");
  meta.className = "meta";
  const took = previous === null ? block.elapsed_s : block.elapsed_s - previous;
  meta.textContent = `block ${block.block} · ${block.elapsed_s.toFixed(2)} s (+${took.toFixed(2)})`;
  meta.title = "seconds from the request's arrival to this block's commit (and since the previous block)";
  const line = document.createElement("div");
  line.className = "block";
  const last = Math.max(0, ...block.commit_steps);
  const cells = block.tokens.map((text, i) => {
    const t = tok("▢", "masked");
    t.dataset.step = block.commit_steps[i];
    t.dataset.text = text;
    line.appendChild(t);
    return t;
  });
  row.append(meta, line);
  $("answer").appendChild(row);
  const delay = Number($("replay").value);
  replaying = replaying.then(async () => {
    for (let step = -1; step <= last; step++) {
      if (delay && step >= 0) await sleep(delay);
      for (const t of cells) {
        const s = Number(t.dataset.step);
        if (s !== step) continue;
        t.textContent = t.dataset.text === "" ? "␀" : t.dataset.text;
        t.className = s < 0 ? "tok undecoded" : "tok committed";
        if (s >= 0) t.style.background = `hsl(${210 - (150 * s) / Math.max(last, 1)}, 75%, 86%)`;
        t.title = s < 0 ? "not decoded (after the answer ended)" : `committed at step ${s} of the block`;
      }
    }
    row.dataset.revealed = "true";
  });
}

async function run() {
  $("go").disabled = true;
  $("answer").replaceChildren();
  $("prompt").replaceChildren();
  $("text").textContent = "";
  status("running", "decoding…");
  const t0 = performance.now();
  let text = "", previous = null, failed = null, tokens = 0;
  try {
    const headers = { "Content-Type": "application/json" };
    if (S.api_key) headers.Authorization = `Bearer ${$("api-key").value}`;
    const reply = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body()) });
    if (!reply.ok) {
      const err = await reply.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${reply.status}`);
    }
    const reader = reply.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) { failed = chunk.error.message; continue; }
        const trace = chunk.dllm || {};
        if (trace.prompt_tokens) showPrompt(trace);
        for (const block of trace.blocks || []) {
          showBlock(block, previous);
          previous = block.elapsed_s;
          tokens += block.token_ids.length;
        }
        text += chunk.choices[0].delta.content || "";
        $("text").textContent = text;
      }
    }
  } catch (e) {
    failed = e.message;
  }
  await replaying;
  if (failed) status("error", failed);
  else status("done", `done: ${tokens} tokens in ${((performance.now() - t0) / 1000).toFixed(2)} s`);
  $("go").disabled = false;
  poll();
}

const COUNTERS = [
  ["dllm_jax_generation_tokens_per_second", "tokens / s (last 10 s)", 1],
  ["dllm_jax_requests_running", "requests running"],
  ["dllm_jax_requests_waiting", "requests waiting"],
  ["dllm_jax_kv_pages_used", "KV pages used"],
  ["dllm_jax_kv_pages_shared", "pages of shared affixes"],
  ["dllm_jax_kv_pages_total", "KV pages in all"],
  ["dllm_jax_affix_builds_total", "affix copies built"],
  ["dllm_jax_affix_hits_total", "requests reusing a copy"],
  ["dllm_jax_programs", "programs"],
  ["dllm_jax_compiles_after_warmup_total", "compiles after warm-up"],
  ["dllm_jax_requests_total", "requests served"],
];

async function poll() {
  try {
    const ready = await fetch("/ready").then((r) => r.json());
    const badge = $("ready");
    badge.className = "badge " + ready.status;
    badge.textContent = ready.status === "warming" ? `warming up ${ready.programs} programs (${ready.seconds} s)` : ready.status;
    const text = await fetch("/metrics").then((r) => r.text());
    const values = Object.fromEntries([...text.matchAll(/^(dllm_jax_\w+) (\S+)$/gm)].map((m) => [m[1], Number(m[2])]));
    const table = $("counters");
    table.replaceChildren();
    for (const [name, label, digits] of COUNTERS) {
      if (!(name in values)) continue;
      const row = table.insertRow();
      row.insertCell().textContent = label;
      row.insertCell().textContent = values[name].toFixed(digits || 0);
      row.title = name;
    }
    const headers = S.api_key ? { Authorization: `Bearer ${$("api-key").value}` } : {};
    showAudit(await fetch("/v1/audit", { headers }).then((r) => (r.ok ? r.json() : null)));
  } catch (e) {
    $("ready").textContent = "unreachable";
  }
}

// The audit's figures per affix and setting (GET /v1/audit): how often the served answer equals the exact one.
function showAudit(audit) {
  const table = $("audit"), note = $("audit-note");
  table.replaceChildren();
  if (!audit) { note.textContent = "unavailable (the API key?)"; return; }
  if (!audit.fraction) { note.textContent = "off (dllm-jax serve --audit-fraction)"; return; }
  note.textContent = `${(100 * audit.fraction).toFixed(0)}% of the requests that share an affix are audited; ` +
    `${audit.audited} compared, ${audit.pending} waiting for room, ${audit.dropped} dropped for users`;
  for (const g of audit.groups.slice(-6).reverse()) {
    const row = table.insertRow();
    row.insertCell().textContent = `${g.setting} · ${g.affix.slice(0, 14)}…`;
    row.insertCell().textContent = `${g.exact_matches}/${g.requests}`;
    const [low, high] = g.exact_match_interval.map((v) => (100 * v).toFixed(0));
    row.insertCell().textContent = `${(100 * g.exact_match_rate).toFixed(0)}% [${low}–${high}]`;
    row.title = `${g.affix}: exact-match rate with its 95% Wilson interval; mean token agreement ${g.mean_token_agreement}`;
  }
}

init();
setInterval(poll, 3000);
