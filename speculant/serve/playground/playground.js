// The playground: chat with the served model over /v1/chat/completions (streamed), each token marked by its
// provenance from the stream's `speculant` chunks (stream_options.include_provenance): an accepted draft, the
// target's correction of a rejected one, or the target's own token. No build step: plain DOM and fetch.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} of the conversation so far
let model = null;

async function api(path, init = {}) {
  const headers = { "content-type": "application/json" };
  if ($("key").value) headers.authorization = `Bearer ${$("key").value}`;
  return fetch(path, { ...init, headers });
}

async function loadModel() {
  const response = await api("/v1/models");
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  model = body.data[0].id;
  $("model").textContent = model;
}

function turn(role) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "model";
  div.append(who);
  $("chat").append(div);
  return div;
}

// Per draft position j: [steps that drafted a j-th token, steps whose j-th draft was accepted].
function plot(positions) {
  const svg = $("positions");
  svg.replaceChildren();
  const n = Math.min(positions.length, 12), w = 240 / Math.max(n, 1);
  for (let j = 0; j < n; j++) {
    const [drafted, accepted] = positions[j];
    const rate = drafted ? accepted / drafted : 0;
    const bar = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    bar.setAttribute("x", j * w + 2); bar.setAttribute("width", w - 4);
    bar.setAttribute("y", 100 - rate * 100); bar.setAttribute("height", rate * 100);
    const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
    label.setAttribute("x", j * w + w / 2 - 3); label.setAttribute("y", 112); label.textContent = j + 1;
    svg.append(bar, label);
  }
}

function body(text) {
  const request = { model, messages: [...history, { role: "user", content: text }], stream: true,
                    stream_options: { include_usage: true, include_provenance: true },
                    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  const speculant = $("options").value.trim() ? JSON.parse($("options").value) : {};
  if ($("method").value) speculant.method = $("method").value;
  if (Object.keys(speculant).length) request.speculant = speculant;
  return request;
}

// The "This reply" panel emptied: what it shows is always the reply being sent or the last one.
function resetStats() {
  for (const id of ["rate", "acceptance", "mean", "drafter"]) $(id).textContent = "-";
  delete $("drafter").dataset.method;
  plot([]);
}

// A turn: the user's text and the model's reply drawn, and added to the history once the reply is complete. A
// turn that fails is taken off the page, its stats with it (its text back in the box to send again), so that the
// chat shows what the model will see next time.
async function send(text) {
  $("error").textContent = "";
  resetStats();
  if (!model) await loadModel();
  const request = body(text);
  const asked = turn("user"), reply = turn("assistant");
  asked.append(text);
  try {
    history.push({ role: "user", content: text }, { role: "assistant", content: await stream(request, reply) });
  } catch (error) {
    asked.remove(); reply.remove(); resetStats();
    if (!$("message").value) $("message").value = text;
    throw error;
  }
}

// The reply to `request` streamed into `reply` (its tokens marked by provenance) and the stats; its text.
async function stream(request, reply) {
  const stats = { tokens: 0, drafted: 0, accepted: 0, steps: 0, positions: [] };
  let content = "", first = null;
  const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(request) });
  if (!response.ok) {
    const error = await response.json();
    throw new Error(error.error ? error.error.message : response.statusText);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.speculant) {  // one step: its tokens and their provenance
        first = first ?? performance.now();
        const step = chunk.speculant;
        for (const token of step.tokens) {
          const span = document.createElement("span");
          span.className = `tok ${token.kind}`;
          span.textContent = token.text;
          span.title = `${token.kind} (id ${token.id})`;
          reply.append(span);
        }
        stats.tokens += step.tokens.length; stats.steps += 1;
        stats.drafted += step.drafted; stats.accepted += step.accepted;
        for (let j = 0; j < step.drafted; j++) {
          stats.positions[j] = stats.positions[j] || [0, 0];
          stats.positions[j][0] += 1;
          if (j < step.accepted) stats.positions[j][1] += 1;
        }
        if (step.drafter) $("drafter").textContent = step.drafter;
        else if (step.drafted) $("drafter").textContent = "lookup (model-free)";
        show(stats, first);
      }
      for (const choice of chunk.choices || []) content += (choice.delta && choice.delta.content) || "";
      if (chunk.usage) $("drafter").dataset.method = chunk.usage.speculative.method;
    }
  }
  return content;
}

function show(stats, first) {
  const seconds = (performance.now() - first) / 1000;
  $("rate").textContent = seconds > 0 && stats.tokens > 1 ? ((stats.tokens - 1) / seconds).toFixed(1) : "-";
  $("acceptance").textContent = stats.drafted ? `${Math.round(100 * stats.accepted / stats.drafted)}%` : "-";
  $("mean").textContent = (stats.tokens / Math.max(stats.steps, 1)).toFixed(2);
  plot(stats.positions);
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text) return;
  $("message").value = "";
  $("send").disabled = true;
  send(text).catch((error) => { $("error").textContent = error.message; })
            .finally(() => { $("send").disabled = false; });
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("ask").requestSubmit(); }
});
$("clear").addEventListener("click", () => { history.length = 0; $("chat").replaceChildren(); });
loadModel().catch((error) => { $("error").textContent = error.message; });
