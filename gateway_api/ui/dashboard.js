// The Agent-Reach dashboard: polls the gateway's API and redraws. No framework, no build step.
// Every value from the API reaches the DOM as text (textContent / text nodes), never as markup:
// instance ids, addresses and checks are written by agents. Links are built here, from the
// server's configured Temporal UI address and encoded ids only.
"use strict";

const TOKEN_KEY = "reach.token";
const REQUEST_LIMIT = 25;
const state = {
  pollMs: 1500,
  temporalUi: null,
  namespace: "default",
  clockOffsetMs: 0, // server clock minus this browser's
  needToken: false,
  timer: null,
  timelineId: null,
  timelineJson: null,
  configLoaded: false,
};

class AuthNeeded extends Error {}

class ApiError extends Error {
  constructor(status, body) {
    const err = body && typeof body === "object" ? body.error || body.detail : null;
    const text = err && typeof err === "object" ? `${err.type || "error"}: ${err.message || ""}` : String(err || "");
    super(`HTTP ${status}${text ? " — " + text : ""}`);
    this.status = status;
  }
}

// ---------------------------------------------------------------------------------------------
// DOM helpers: text only.

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key === "title") node.title = String(value);
    else if (key === "href") node.setAttribute("href", value);
    else if (key.startsWith("data-") || ["target", "rel", "colspan"].includes(key)) node.setAttribute(key, String(value));
    else throw new Error(`el: unexpected attribute ${key}`);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function badge(value) {
  const text = String(value ?? "");
  // The class only from a closed set (it never carries data into CSS or markup).
  const known = ["ok", "degraded", "unhealthy", "success", "error", "timeout", "running", "accepted", "open", "half_open", "closed"];
  return el("span", { class: "badge" + (known.includes(text) ? " b-" + text : ""), text });
}

function $(id) {
  return document.getElementById(id);
}

// ---------------------------------------------------------------------------------------------
// Formatting.

function ago(seconds) {
  if (!Number.isFinite(seconds)) return "-";
  const s = Math.max(0, seconds);
  if (s < 10) return s.toFixed(1) + "s";
  if (s < 60) return Math.round(s) + "s";
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  const h = Math.floor(m / 60);
  if (h < 24) return `${h}h${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(h / 24)}d${String(h % 24).padStart(2, "0")}h`;
}

function serverNow() {
  return (Date.now() + state.clockOffsetMs) / 1000;
}

// Epoch seconds (or milliseconds) or an ISO string -> epoch seconds.
function epochSeconds(value) {
  if (value === null || value === undefined || value === "") return NaN;
  if (typeof value === "number") return value > 1e12 ? value / 1000 : value;
  const parsed = Date.parse(value);
  return Number.isNaN(parsed) ? NaN : parsed / 1000;
}

function duration(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(Number(ms))) return "-";
  const n = Number(ms);
  return n < 10000 ? `${Math.round(n)} ms` : `${(n / 1000).toFixed(1)} s`;
}

function compact(checks) {
  if (!checks || typeof checks !== "object") return "-";
  const parts = Object.entries(checks).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`);
  const text = parts.join(" ");
  return text.length > 120 ? text.slice(0, 119) + "…" : text || "-";
}

function temporalLink(requestId) {
  const base = state.temporalUi;
  if (!base || !/^https?:\/\//.test(base)) return null;
  return `${base.replace(/\/+$/, "")}/namespaces/${encodeURIComponent(state.namespace)}/workflows/${encodeURIComponent(requestId)}`;
}

function timelineHref(requestId) {
  return "#timeline/" + encodeURIComponent(requestId);
}

// ---------------------------------------------------------------------------------------------
// The API.

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  let response;
  try {
    response = await fetch(path, { headers, cache: "no-store" });
  } catch (exc) {
    setConn("down", "gateway unreachable — retrying");
    throw exc;
  }
  if (response.status === 401) {
    askToken(token ? "the gateway refused this token" : "");
    throw new AuthNeeded();
  }
  let body = null;
  try {
    body = await response.json();
  } catch (exc) {
    body = null;
  }
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

function setConn(kind, text) {
  const conn = $("conn");
  conn.className = "conn conn-" + kind;
  conn.textContent = text;
}

function askToken(message) {
  state.needToken = true;
  $("token-form").hidden = false;
  $("token-error").textContent = message || "";
  setConn("wait", "waiting for a token");
  $("token-input").focus();
}

function onTokenSubmit(event) {
  event.preventDefault();
  const token = $("token-input").value.trim();
  if (!/^[\x21-\x7e]+$/.test(token)) {
    $("token-error").textContent = "a token is visible ASCII, without spaces";
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  $("token-input").value = "";
  $("token-form").hidden = true;
  state.needToken = false;
  schedule(0);
}

// ---------------------------------------------------------------------------------------------
// Sections.

async function loadConfig() {
  const sent = Date.now();
  const config = await api("ui/config.json");
  const received = Date.now();
  state.temporalUi = typeof config.temporal_ui === "string" ? config.temporal_ui : null;
  state.namespace = String(config.namespace || "default");
  state.pollMs = Math.min(10000, Math.max(500, Number(config.poll_ms) || 1500));
  state.clockOffsetMs = Number(config.server_time) * 1000 - (sent + received) / 2;
  state.configLoaded = true;
}

async function refreshCapabilities() {
  const list = await api("reach/capabilities");
  const names = (list.capabilities || []).map((c) => String(c.name)).sort();
  const details = await Promise.all(
    names.map((name) =>
      api("reach/capabilities/" + encodeURIComponent(name)).catch((exc) => {
        if (exc instanceof ApiError && exc.status === 404) return null; // forgotten meanwhile
        throw exc;
      }),
    ),
  );
  const now = serverNow();
  const cards = [];
  let total = 0;
  const health = {};
  for (const detail of details) {
    if (!detail) continue;
    const instances = (detail.instances || []).slice().sort((a, b) => String(a.instance_id).localeCompare(String(b.instance_id)));
    const inflight = (detail.routing && detail.routing.inflight) || {};
    const breaker = detail.policy && detail.policy.breaker;
    const ejected = (detail.policy && detail.policy.ejected) || {};
    total += instances.length;
    const routable = instances.filter((i) => i.status !== "unhealthy").length;
    const head = el(
      "h3",
      {},
      el("span", { class: "mono", text: detail.name }),
      el("span", {
        class: "meta",
        text: `${instances.length} instance${instances.length === 1 ? "" : "s"}, ${routable} routable` +
          (detail.routing ? ` · ${detail.routing.strategy}` : ""),
      }),
      breaker && breaker.status !== "closed" ? el("span", {}, "breaker ", badge(breaker.status)) : null,
    );
    const rows = instances.map((i) => {
      health[i.status] = (health[i.status] || 0) + 1;
      const ejectedFor = Object.hasOwn(ejected, i.instance_id) ? ejected[i.instance_id] : null;
      return el(
        "tr",
        { "data-instance": i.instance_id, "data-status": i.status },
        el("td", { class: "mono", text: i.instance_id }),
        el("td", { text: i.protocol }),
        el("td", { class: "mono", text: i.address }),
        el("td", {}, badge(i.status), ejectedFor ? el("span", { class: "note", text: ` ejected ${Math.round(ejectedFor)}s` }) : null),
        el("td", { class: "checks mono", text: compact(i.checks), title: JSON.stringify(i.checks || {}, null, 1) }),
        el("td", { class: "num", text: Object.hasOwn(inflight, i.instance_id) ? inflight[i.instance_id] : 0 }),
        el("td", { class: "num", text: ago(now - Number(i.last_seen)) + " ago" }),
        el("td", { class: "num", text: ago(now - Number(i.joined_at)) }),
      );
    });
    const body = rows.length
      ? el(
          "table",
          { class: "grid" },
          el(
            "thead",
            {},
            el("tr", {}, ...["Instance", "Protocol", "Address", "Health", "Checks", "In flight", "Last heartbeat", "Up"].map(
              (h, n) => el("th", { class: n >= 5 ? "num" : null, text: h }),
            )),
          ),
          el("tbody", {}, ...rows),
        )
      : el("p", { class: "note", text: "no instances (all left or were evicted)" });
    cards.push(el("div", { class: "capability", "data-capability": detail.name }, head, body));
  }
  $("capabilities").replaceChildren(...cards);
  $("capabilities-note").textContent = cards.length ? "" : "No capabilities registered yet: start an agent (reach up starts two demo agents).";
  const parts = Object.entries(health).map(([k, v]) => `${v} ${k}`);
  $("summary").textContent = `${cards.length} capabilit${cards.length === 1 ? "y" : "ies"} · ${total} instance${total === 1 ? "" : "s"}` +
    (parts.length ? ` (${parts.join(", ")})` : "");
}

async function refreshRequests() {
  let data;
  try {
    data = await api(`reach/requests?limit=${REQUEST_LIMIT}`);
  } catch (exc) {
    if (exc instanceof ApiError) {
      $("requests-note").textContent = `The request list is unavailable (${exc.message}).`;
      $("requests-body").replaceChildren();
      return;
    }
    throw exc;
  }
  const requests = (data && data.requests) || [];
  const now = serverNow();
  const rows = requests.map((r) => {
    const id = String(r.request_id);
    const started = epochSeconds(r.started_at);
    const link = temporalLink(id);
    return el(
      "tr",
      { "data-request-id": id, "data-status": r.status },
      el("td", { class: "mono", text: id }),
      el("td", { class: "mono", text: `${r.capability ?? "-"} · ${r.operation ?? "-"}` }),
      el("td", { text: r.caller ?? "-" }),
      el("td", {}, badge(r.status)),
      el("td", { class: "mono", text: r.instance ?? "-" }),
      el("td", {
        text: Number.isNaN(started) ? "-" : ago(now - started) + " ago",
        title: Number.isNaN(started) ? null : new Date(started * 1000).toLocaleString(),
      }),
      el("td", { class: "num", text: duration(r.duration_ms) }),
      el(
        "td",
        { class: "links" },
        el("a", { class: "timeline-link", href: timelineHref(id), text: "timeline" }),
        link ? el("a", { class: "temporal-link", href: link, target: "_blank", rel: "noopener noreferrer", text: "Temporal ↗" }) : null,
      ),
    );
  });
  $("requests-body").replaceChildren(...rows);
  $("requests-note").textContent = rows.length ? "" : "No requests yet.";
}

function timelineFromHash() {
  const match = /^#timeline\/(.+)$/.exec(location.hash);
  if (!match) return null;
  try {
    return decodeURIComponent(match[1]);
  } catch (exc) {
    return null;
  }
}

async function refreshTimeline() {
  const id = state.timelineId;
  if (!id) return;
  let data;
  try {
    data = await api(`reach/requests/${encodeURIComponent(id)}/timeline`);
  } catch (exc) {
    if (exc instanceof ApiError && id === state.timelineId) {
      $("timeline-note").textContent = `The timeline is unavailable (${exc.message}).`;
      $("timeline").replaceChildren();
      state.timelineJson = null;
      return;
    }
    throw exc;
  }
  if (id !== state.timelineId) return; // another one was opened meanwhile
  const link = temporalLink(id);
  const ext = $("timeline-temporal");
  ext.hidden = !link;
  if (link) ext.setAttribute("href", link);
  const json = JSON.stringify(data);
  if (json === state.timelineJson) return; // unchanged: keep open details as they are
  state.timelineJson = json;
  $("timeline-status").replaceChildren(badge(data.status));
  $("timeline-status").className = "";
  const events = data.events || [];
  $("timeline-note").textContent = events.length ? "" : "No events yet.";
  $("timeline").replaceChildren(
    ...events.map((e) => {
      const hasDetail = e.detail && typeof e.detail === "object" && Object.keys(e.detail).length > 0;
      return el(
        "li",
        { class: "event", "data-kind": e.kind },
        el("span", { class: "at", text: `+${Math.round(Number(e.at_ms) || 0)} ms` }),
        el("span", { class: "kind", text: e.kind }),
        el("span", { class: "summary-text", text: e.summary ?? "" }),
        hasDetail ? el("details", {}, el("summary", { text: "detail" }), el("pre", { text: JSON.stringify(e.detail, null, 2) })) : null,
      );
    }),
  );
}

function openTimelineFromHash() {
  const id = timelineFromHash();
  const section = $("timeline-section");
  if (!id) {
    state.timelineId = null;
    section.hidden = true;
    return;
  }
  if (id !== state.timelineId) {
    state.timelineId = id;
    state.timelineJson = null;
    $("timeline-id").textContent = id;
    $("timeline-status").replaceChildren();
    $("timeline").replaceChildren();
    $("timeline-note").textContent = "loading…";
    $("timeline-temporal").hidden = true;
  }
  section.hidden = false;
  section.scrollIntoView({ block: "start" });
  refreshTimeline().catch(() => {});
}

// ---------------------------------------------------------------------------------------------
// The loop.

async function tick() {
  state.timer = null;
  if (state.needToken) return; // resumes when a token is given
  try {
    if (!state.configLoaded) await loadConfig();
    await Promise.all([refreshCapabilities(), refreshRequests(), refreshTimeline()]);
    setConn("live", "live · " + new Date().toLocaleTimeString());
  } catch (exc) {
    if (exc instanceof AuthNeeded) return;
    if (exc instanceof ApiError) {
      if (exc.status === 403) setConn("down", "this token may not read the gateway (403)");
      else setConn("down", exc.message);
    } else if (!(exc instanceof TypeError)) {
      setConn("down", String(exc));
    }
  }
  schedule(state.pollMs);
}

function schedule(ms) {
  if (state.timer !== null) clearTimeout(state.timer);
  state.timer = setTimeout(tick, ms);
}

document.addEventListener("DOMContentLoaded", () => {
  $("token-form").addEventListener("submit", onTokenSubmit);
  $("timeline-close").addEventListener("click", () => {
    history.replaceState(null, "", location.pathname + location.search);
    openTimelineFromHash();
  });
  window.addEventListener("hashchange", openTimelineFromHash);
  openTimelineFromHash();
  schedule(0);
});
