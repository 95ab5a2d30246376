// pagedllm web chat: streams /v1/chat/completions (server-sent events) into the page.
// Plain JS, no dependencies. The stop button aborts the fetch; the server then aborts the request.
"use strict";

const $ = (id) => document.getElementById(id);
const els = {
  model: $("model"), system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"),
  apiKey: $("api-key"), messages: $("messages"), input: $("input"), send: $("send"), stop: $("stop"),
  status: $("status"), composer: $("composer"), clear: $("clear"),
};

const history = [];        // the conversation: {role, content}
let controller = null;     // AbortController of the generation in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = els.apiKey.value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text) { els.status.textContent = text; }

function setBusy(busy) {
  els.send.disabled = busy;
  els.stop.disabled = !busy;
  els.model.disabled = busy;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  const note = document.createElement("span");
  note.className = "note";
  div.appendChild(note);
  els.messages.appendChild(div);
  els.messages.scrollTop = els.messages.scrollHeight;
  return div;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    const e = body.error;
    return (e && (e.message || e)) || JSON.stringify(body);
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

async function loadModels() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) throw new Error(await errorText(resp));
    const data = (await resp.json()).data || [];
    const previous = els.model.value;
    els.model.innerHTML = "";
    for (const m of data) {
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = m.id + (m.max_model_len ? "  (" + m.max_model_len + " ctx)" : "");
      els.model.appendChild(opt);
    }
    if (previous && data.some((m) => m.id === previous)) els.model.value = previous;
    setStatus(data.length ? "Ready." : "The server lists no models.");
  } catch (e) {
    setStatus("Could not list the models: " + e.message);
  }
}

function formatStats(tokens, tFirst, tStart, tNow) {
  let s = tokens + (tokens === 1 ? " token" : " tokens");
  if (tFirst !== null) {
    const secs = (tNow - tFirst) / 1000;
    if (tokens > 1 && secs > 0) s += " \u00b7 " + ((tokens - 1) / secs).toFixed(1) + " tok/s";
    s += " \u00b7 first token " + ((tFirst - tStart) / 1000).toFixed(2) + " s";
  }
  return s;
}

async function send(text) {
  if (controller) return;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const textEl = bubble.querySelector(".text");
  const noteEl = bubble.querySelector(".note");
  bubble.dataset.state = "streaming";

  const messages = [];
  const system = els.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    model: els.model.value || undefined, messages, stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
  };
  const temp = parseFloat(els.temperature.value);
  if (!Number.isNaN(temp)) body.temperature = temp;
  const maxTokens = parseInt(els.maxTokens.value, 10);
  if (!Number.isNaN(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;

  controller = new AbortController();
  setBusy(true);
  const tStart = performance.now();
  let tFirst = null, tokens = 0, answer = "", finish = null;
  setStatus("Waiting for the first token\u2026");
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
          if (chunk.usage && typeof chunk.usage.completion_tokens === "number") {
            tokens = chunk.usage.completion_tokens;
          }
          for (const choice of chunk.choices || []) {
            const piece = (choice.delta && choice.delta.content) || "";
            if (piece) {
              if (tFirst === null) tFirst = performance.now();
              answer += piece;
              textEl.textContent = answer;
              els.messages.scrollTop = els.messages.scrollHeight;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
          setStatus(formatStats(tokens, tFirst, tStart, performance.now()));
        }
      }
    }
    bubble.dataset.state = "done";
    setStatus(formatStats(tokens, tFirst, tStart, performance.now()) +
              (finish ? " \u00b7 finish: " + finish : ""));
  } catch (e) {
    if (e.name === "AbortError") {
      bubble.dataset.state = "stopped";
      noteEl.textContent = "(stopped)";
      setStatus("Stopped. " + formatStats(tokens, tFirst, tStart, performance.now()));
    } else {
      bubble.dataset.state = "error";
      noteEl.textContent = "Error: " + e.message;
      setStatus("Error: " + e.message);
    }
  } finally {
    // Keep what was said (also a stopped partial answer) so the conversation goes on from it.
    if (answer) history.push({ role: "assistant", content: answer });
    else if (history.length && history[history.length - 1].role === "user") history.pop();
    controller = null;
    setBusy(false);
    els.input.focus();
  }
}

els.composer.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = els.input.value.trim();
  if (!text || controller) return;
  els.input.value = "";
  send(text);
});
els.input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    els.composer.requestSubmit();
  }
});
els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
els.clear.addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  els.messages.innerHTML = "";
  setStatus("New conversation.");
});
els.apiKey.addEventListener("change", loadModels);

setBusy(false);
loadModels();
