// Backstop's operator dashboard. Plain DOM and SVG, no framework, nothing loaded from
// elsewhere. Every value from the server goes in as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "backstop.admin.token";
const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";

let timer = null;
let polling = false;
let openTrace = null; // {tenant, session}
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const child of children) node.append(child);
  return node;
}

const fmt = {
  usd: (v) => (v === null || v === undefined ? "–" : "$" + Number(v).toFixed(v >= 100 ? 0 : 4)),
  int: (v) => (v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US")),
  ms: (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(v >= 100 ? 0 : 1) + " ms"),
  s: (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2) + " s"),
  pct: (v) => (v === null || v === undefined ? "–" : Math.round(v * 100) + "%"),
  ago: (ms) => {
    const s = Math.round(ms / 1000);
    return s < 60 ? s + " s ago" : Math.round(s / 60) + " min ago";
  },
};

function stateBadge(state, kind) {
  const cls = kind === "breaker" ? "state brk-" + state : "state state-" + state;
  return el("span", { class: cls }, state.replace("_", "-"));
}

// --- token and errors -------------------------------------------------------------

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// A call to the admin API with the token in the Authorization header. The admin API
// answers refusals in the OpenAI error shape: its message is what the operator sees.
async function api(path, options) {
  const response = await fetch(path, {
    ...(options || {}),
    cache: "no-store",
    headers: { Authorization: "Bearer " + token(), Accept: "application/json" },
  });
  const text = await response.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const message = (body && body.error && body.error.message) || text || response.statusText;
    throw new ApiError(response.status, "HTTP " + response.status + ": " + message);
  }
  return body;
}

function loggedOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  stopPolling();
  $("dashboard").hidden = true;
  $("logout").hidden = true;
  $("pause-label").hidden = true;
  $("login-panel").hidden = false;
  showError(message || "");
  $("token").focus();
}

function failed(err) {
  if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
    loggedOut("The admin API refused the token. " + err.message);
  } else {
    showError("Cannot refresh: " + err.message + " (retrying every " + POLL_MS / 1000 + " s)");
  }
}

// --- polling ----------------------------------------------------------------------

function query() {
  const params = new URLSearchParams();
  const tenant = $("filter-tenant").value;
  const state = $("filter-state").value;
  if (tenant) params.set("tenant", tenant);
  if (state) params.set("state", state);
  params.set("limit", $("filter-limit").value);
  return params.toString();
}

async function refresh() {
  if (polling || !token()) return;
  polling = true;
  try {
    const data = await api("/admin/ui/data?" + query());
    showError("");
    $("login-panel").hidden = true;
    $("dashboard").hidden = false;
    $("logout").hidden = false;
    $("pause-label").hidden = false;
    render(data);
    if (openTrace) await loadTrace(openTrace.tenant, openTrace.session, false);
  } catch (err) {
    failed(err);
  } finally {
    polling = false;
  }
}

function startPolling() {
  stopPolling();
  refresh();
  timer = setInterval(() => {
    if (!$("paused").checked) refresh();
  }, POLL_MS);
}

function stopPolling() {
  if (timer) clearInterval(timer);
  timer = null;
}

// --- rendering --------------------------------------------------------------------

function render(data) {
  $("config").textContent = "config v" + data.config.version + ", loaded " + data.config.loaded_at;
  $("updated").textContent = "updated " + data.generated_at;
  $("memory").textContent = data.memory_only;
  renderRecovery(data.recovery.minutes);
  renderUpstreams(data.upstreams);
  renderTenants(data.tenants);
  renderFleet(data.fleet || []);
  renderRestarts(data.restarts || []);
  renderSessions(data.sessions, data.tenants);
}

// One line per tenant with a fleet view (trips by reason, how well it predicts), then
// its signatures, hot first.
function renderFleet(fleet) {
  $("fleet-panel").hidden = fleet.length === 0;
  $("fleet-tenants").replaceChildren(...fleet.map((f) => {
    const trips = Object.entries(f.trips_by_reason).map(([r, n]) => r + " " + n).join(", ") || "none";
    const p = f.predictions;
    const precision = p.precision === null ? "–" : Math.round(p.precision * 100) + "%";
    return el("div", { class: "tenant", "data-fleet-tenant": f.tenant },
      el("b", {}, f.tenant), el("span", { class: "muted" }, " · " + f.hot + " hot of " + f.counted + " signatures · " +
        f.policy.min_sessions + " sessions x " + f.policy.min_failures + " failures in " + f.policy.window +
        (f.policy.preempt ? ", preempt" : "") + ", cool-down " + f.policy.cool_down + (f.error ? " · " + f.error : "")),
      el("div", {}, "trips by reason: " + trips + " · predictions confirmed " + fmt.int(p.confirmed) + ", not " +
        fmt.int(p.unconfirmed) + " (" + precision + "), pending " + fmt.int(p.pending) + " · avoided " +
        fmt.int(f.record.avoided_calls) + " calls, " + fmt.usd(f.record.avoided_usd)));
  }));
  const rows = fleet.flatMap((f) => f.signatures.map((s) => [f.tenant, s]));
  $("fleet").tBodies[0].replaceChildren(...rows.map(([tenant, s]) => {
    const state = s.state === "hot" ? "tripped" : s.state === "cooled" ? "active" : "recovering";
    const probe = s.next_probe ? " (probe at " + s.next_probe + ")" : "";
    return el("tr", { "data-signature": s.id, "data-state": s.state },
      el("td", {}, tenant),
      el("td", { class: "trip" }, el("code", {}, s.id), " ", s.description),
      el("td", { class: "nowrap" }, el("span", { class: "state state-" + state }, s.state), probe),
      el("td", { class: "num" }, fmt.int(s.sessions) + " (" + fmt.int(s.sessions_at_min_failures) + ")"),
      el("td", { class: "nowrap" }, s.first_seen, el("br", {}), s.last_seen),
      el("td", { class: "num" }, fmt.int(s.record.tripped) + " / " + fmt.int(s.record.preempted)),
      el("td", { class: "num" }, fmt.int(s.record.confirmed) + " / " + fmt.int(s.record.unconfirmed)),
      el("td", { class: "num" }, fmt.int(s.record.avoided_calls) + " calls, " + fmt.usd(s.record.avoided_usd)));
  }));
}

// One table per guarded tenant: a row per restart strategy and their total, then the
// sessions failed fast, trips by rule and what the trips saved.
function renderRestarts(restarts) {
  $("restarts-panel").hidden = restarts.length === 0;
  $("restarts").replaceChildren(...restarts.map((r) => {
    const trips = Object.entries(r.trips_by_rule).map(([rule, n]) => rule + " " + n).join(", ") || "none";
    const rows = Object.entries(r.strategies).concat([["total", r.total]]).map(([name, t]) =>
      el("tr", { "data-strategy": name },
        el("td", {}, name),
        el("td", { class: "num" }, fmt.int(t.sessions)),
        el("td", { class: "num" }, fmt.int(t.recovered)),
        el("td", { class: "num" }, fmt.int(t.tripped_after)),
        el("td", { class: "num" }, fmt.pct(t.success_rate)),
        el("td", { class: "num nowrap" }, fmt.s(t.mttr_seconds.mean) + " / " + fmt.s(t.mttr_seconds.p90))));
    const p = r.policy;
    return el("div", { class: "tenant restarts", "data-tenant": r.tenant },
      el("b", {}, r.tenant), el("span", { class: "muted" }, " · " + r.backend + " · guide " + (p.guide ? "on" : "off") +
        ", same error x" + p.same_error_limit + ", cool-down " + p.cool_down_seconds + " s" + (r.error ? " · " + r.error : "")),
      el("table", {},
        el("thead", {}, el("tr", {}, el("th", {}, "strategy"), el("th", { class: "num" }, "sessions"),
          el("th", { class: "num" }, "recovered"), el("th", { class: "num" }, "tripped after"),
          el("th", { class: "num", title: "recovered ÷ sessions" }, "success"),
          el("th", { class: "num", title: "from the session's first failure to its recovery" }, "MTTR mean / p90"))),
        el("tbody", {}, rows)),
      el("div", { class: "restart-trips" }, "failed fast " + fmt.int(r.fail_fast.sessions) + " · trips by rule: " + trips +
        " · saved by trips " + fmt.int(r.saved_by_trips.calls) + " calls, " + fmt.usd(r.saved_by_trips.usd)));
  }));
}

function sum(minutes, pick) {
  return minutes.reduce((n, m) => n + pick(m), 0);
}

function refusedOf(m) {
  return Object.values(m.refused || {}).reduce((a, b) => a + b, 0);
}

function renderRecovery(minutes) {
  const totals = $("recovery-totals");
  const refusedBy = {};
  for (const m of minutes) {
    for (const [reason, n] of Object.entries(m.refused || {})) refusedBy[reason] = (refusedBy[reason] || 0) + n;
  }
  const refusedText = Object.entries(refusedBy).map(([r, n]) => r + " " + n).join(", ") || "none";
  totals.replaceChildren(
    el("span", { id: "total-requests" }, "requests ", el("b", {}, fmt.int(sum(minutes, (m) => m.requests)))),
    el("span", { id: "total-failed" }, "failed ", el("b", {}, fmt.int(sum(minutes, (m) => m.failed)))),
    el("span", { id: "total-retries" }, "retries ", el("b", {}, fmt.int(sum(minutes, (m) => m.retries)))),
    el("span", { id: "total-corrections" }, "corrections ", el("b", {}, fmt.int(sum(minutes, (m) => m.corrections)))),
    el("span", { id: "total-failovers" }, "failovers ", el("b", {}, fmt.int(sum(minutes, (m) => m.failovers)))),
    el("span", { id: "total-refused" }, "refused ", el("b", {}, refusedText)),
  );

  // Two stacked bars a minute: requests by outcome (left), recovery actions (right).
  const W = 960, H = 110, top = 4, bottom = 16;
  const slot = W / minutes.length;
  const max = Math.max(1, ...minutes.map((m) => Math.max(m.requests, m.retries + m.corrections + m.failovers)));
  const scale = (H - top - bottom) / max;
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": "requests and recovery per minute, last hour" });
  minutes.forEach((m, i) => {
    const x = i * slot;
    const refused = refusedOf(m);
    const ok = Math.max(0, m.requests - m.failed - refused);
    const stack = (x0, parts) => {
      let y = H - bottom;
      for (const [cls, n, label] of parts) {
        if (!n) continue;
        const h = n * scale;
        y -= h;
        chart.append(svg("rect", { x: x0, y, width: slot * 0.42, height: h, class: cls }, svg("title", {}, `${60 - i} min ago: ${n} ${label}`)));
      }
    };
    stack(x + slot * 0.05, [["s-ok", ok, "answered"], ["s-failed", m.failed, "failed"], ["s-refused", refused, "refused"]]);
    stack(x + slot * 0.5, [["s-retry", m.retries, "retries"], ["s-correct", m.corrections, "corrections"], ["s-failover", m.failovers, "failovers"]]);
  });
  chart.append(svg("line", { x1: 0, y1: H - bottom, x2: W, y2: H - bottom, stroke: "#999" }));
  for (const [i, label] of [[0, "-60 min"], [30, "-30 min"], [59, "now"]]) {
    chart.append(svg("text", { x: i * slot + (i === 59 ? -10 : 2), y: H - 3, "font-size": 11, fill: "#3a4150" }, document.createTextNode(label)));
  }
  const legend = el("div", { class: "legend" },
    ...[["s-ok", "answered"], ["s-failed", "failed"], ["s-refused", "refused"], ["s-retry", "retries"], ["s-correct", "corrections"], ["s-failover", "failovers"]]
      .map(([cls, label]) => el("span", {}, el("span", { class: "swatch " + cls }), label)),
    el("span", { class: "muted" }, "left bar: requests by outcome; right bar: recovery actions; max " + max + " a minute"));
  $("recovery-chart").replaceChildren(chart, legend);
}

function sparkline(perMinute) {
  const W = 90, H = 16;
  const max = Math.max(1, ...perMinute.map((m) => m.attempts));
  const step = W / perMinute.length;
  const node = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "attempts per minute" });
  perMinute.forEach((m, i) => {
    if (!m.attempts) return;
    const h = (m.attempts / max) * H, f = (m.failures / max) * H;
    node.append(svg("rect", { x: i * step, y: H - h, width: step, height: h - f, class: "s-ok" }));
    if (f) node.append(svg("rect", { x: i * step, y: H - f, width: step, height: f, class: "s-refused" }));
  });
  return node;
}

function renderUpstreams(upstreams) {
  const body = $("upstreams").tBodies[0];
  body.replaceChildren(...upstreams.map((u) => {
    const c = u.hour.by_class;
    const attempts = Object.values(c).reduce((a, b) => a + b, 0);
    const failures = ["transient", "rate_limited", "malformed", "credential", "redirect"].filter((k) => c[k]).map((k) => k + " " + c[k]);
    const breaker = u.breaker;
    const detail = breaker.state === "open" ? " (half-open in " + Math.ceil(breaker.half_open_in_ms / 1000) + " s)"
      : breaker.state === "closed" && breaker.consecutive_failures ? " (" + breaker.consecutive_failures + " failing)" : "";
    const transitions = u.hour.transitions.slice(-4).reverse().map((t) => "→" + t.to + " " + fmt.ago(t.ago_ms)).join(", ");
    return el("tr", { "data-upstream": u.name },
      el("td", { class: "nowrap" }, el("b", {}, u.name), " ", el("span", { class: "muted" }, u.api || "")),
      el("td", {}, stateBadge(breaker.state, "breaker"), detail),
      el("td", { class: "num nowrap" }, fmt.int(attempts), " ", sparkline(u.hour.per_minute)),
      el("td", {}, failures.join(", ") || "none", c.caller_fault ? el("span", { class: "muted" }, " · caller fault " + c.caller_fault) : null),
      el("td", { class: "num nowrap" }, fmt.ms(u.latency_ms.p50) + " / " + fmt.ms(u.latency_ms.p95)),
      el("td", {}, (u.hour.transitions.length ? u.hour.transitions.length + ": " + transitions : "none")));
  }));
}

function bar(label, used, limit, format) {
  const W = 160, H = 10;
  const ratio = limit ? Math.min(1, used / limit) : 0;
  const cls = ratio >= 0.9 ? "s-refused" : ratio >= 0.7 ? "s-retry" : "s-ok";
  const node = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label + " against the daily budget" });
  node.append(svg("rect", { x: 0, y: 0, width: W, height: H, fill: "#eceef2", stroke: "#9aa1ae" }));
  if (limit) node.append(svg("rect", { x: 0, y: 0, width: W * ratio, height: H, class: cls }));
  const text = format(used) + (limit ? " of " + format(limit) + " (" + Math.round(ratio * 100) + "%)" : " (no daily cap)");
  return el("div", { class: "bar" }, el("span", { class: "label" }, label), node, el("span", {}, text));
}

function renderTenants(tenants) {
  $("tenants").replaceChildren(...tenants.map((t) => {
    if (t.error) return el("div", { class: "tenant" }, el("b", {}, t.tenant), " ", el("span", { class: "muted" }, "cannot read: " + t.error));
    const models = (t.by_model || []).map((m) => m.model + " " + fmt.usd(m.usd)).join(", ");
    return el("div", { class: "tenant", "data-tenant": t.tenant },
      el("div", {}, el("b", {}, t.tenant), t.guarded ? el("span", { class: "muted" }, " · guarded") : null,
        el("span", { class: "muted" }, " · " + fmt.int(t.used_today.calls) + " calls")),
      bar("spend", t.used_today.usd, t.limits.usd_per_day, fmt.usd),
      bar("tokens", t.used_today.tokens, t.limits.tokens_per_day, fmt.int),
      el("div", { class: "models" }, "top models: " + (models || "none yet")));
  }));
}

function syncTenantFilter(tenants) {
  const select = $("filter-tenant");
  const have = Array.from(select.options).map((o) => o.value);
  const want = [""].concat(tenants.map((t) => t.tenant));
  if (have.join("\n") === want.join("\n")) return;
  const current = select.value;
  select.replaceChildren(el("option", { value: "" }, "all"), ...tenants.map((t) => el("option", { value: t.tenant }, t.tenant)));
  select.value = want.includes(current) ? current : "";
}

function tripText(trip) {
  if (!trip) return "";
  return trip.code + " (" + trip.rule + "): " + trip.evidence + (trip.probe_in_ms !== undefined ? "; probe in " + Math.ceil(trip.probe_in_ms / 1000) + " s" : "");
}

function renderSessions(sessions, tenants) {
  syncTenantFilter(tenants);
  const shown = sessions.items.length;
  $("sessions-count").textContent = "(" + shown + " shown of " + sessions.total + (sessions.total > shown ? ", most urgent first" : "") + ")";
  $("by-state").textContent = Object.entries(sessions.by_state).sort().map(([s, n]) => s + " " + n).join(" · ");
  const body = $("sessions").tBodies[0];
  body.replaceChildren(...sessions.items.map((s) => {
    const guarded = s.state !== "unguarded";
    const selected = openTrace && openTrace.tenant === s.tenant && openTrace.session === s.session;
    return el("tr", { "data-tenant": s.tenant, "data-session": s.session, "data-state": s.state, class: selected ? "selected" : null },
      el("td", {}, s.tenant),
      el("td", {}, el("code", {}, s.session)),
      el("td", { class: "session-state" }, stateBadge(s.state, "session")),
      el("td", { class: "num" }, s.risk === null ? "–" : Number(s.risk).toFixed(2)),
      el("td", { class: "num" }, fmt.int(s.calls)),
      el("td", { class: "num" }, fmt.int(s.tokens)),
      el("td", { class: "num" }, fmt.usd(s.usd)),
      el("td", { class: "trip" }, tripText(s.trip)),
      el("td", {},
        // Every session has a panel: the guard's trace and signals, its committed side effects.
        el("button", { type: "button", class: "trace", onclick: () => loadTrace(s.tenant, s.session, true) }, "Trace"), " ",
        el("button", { type: "button", class: "reset", onclick: () => act("reset", s.tenant, s.session) }, "Reset"), " ",
        guarded && s.state !== "closed" ? el("button", { type: "button", class: "close danger", onclick: () => act("close", s.tenant, s.session) }, "Close") : null));
  }));
}

function sessionPath(tenant, session) {
  return "/admin/tenants/" + encodeURIComponent(tenant) + "/sessions/" + encodeURIComponent(session);
}

async function loadTrace(tenant, session, scroll) {
  try {
    const report = await api(sessionPath(tenant, session));
    openTrace = { tenant, session };
    const guard = report.guard || { trace: [], signals: null };
    $("trace-title").textContent = tenant + " / " + session;
    const sig = guard.signals;
    $("trace-signals").textContent = sig
      ? "state " + sig.state + " · risk " + sig.risk + " · consecutive failures " + sig.consecutive_failures +
        " · identical requests " + sig.max_identical_requests_in_window + " · tool loop " + sig.tool_loop_count +
        (sig.trip ? " · trip: " + tripText(sig.trip) : "") + " · used " + report.used.calls + " calls, " + fmt.usd(report.used.usd)
      : "no guard for this tenant";
    // Side effects the session committed (`[tenants.side_effects]`), oldest first.
    const committed = (report.side_effects && report.side_effects.committed) || [];
    $("trace-effects").hidden = committed.length === 0;
    $("trace-effects").textContent = committed.length === 0 ? "" : "side effects committed: " +
      committed.map((e) => e.tool + (e.arguments ? " " + e.arguments : "") + " (" + e.call_id + ")" +
        (e.result !== null && e.result !== undefined ? " → " + e.result : "") +
        (e.repeats ? " · proposed again " + e.repeats + "×" : "")).join("; ");
    const entries = guard.trace.slice().reverse();
    $("trace").tBodies[0].replaceChildren(...entries.map((t, i) => el("tr", {},
      el("td", { class: "num" }, guard.trace.length - i),
      el("td", {}, el("code", {}, t.request_id)),
      el("td", { class: "num" }, t.status || "–"),
      el("td", {}, t.class),
      el("td", {}, el("code", {}, t.action)),
      el("td", { class: "num" }, t.attempts),
      el("td", {}, t.upstream || "–"),
      el("td", { class: "num" }, fmt.ms(t.latency_ms)),
      el("td", { class: "num" }, fmt.usd(t.cost_usd)),
      el("td", {}, t.state),
      el("td", {}, t.detail || ""))));
    $("trace-panel").hidden = false;
    if (scroll) $("trace-panel").scrollIntoView({ block: "nearest" });
  } catch (err) {
    failed(err);
  }
}

async function act(action, tenant, session) {
  const what = action === "close"
    ? "Close session " + session + " of " + tenant + "? The guard will refuse it from now on."
    : "Reset session " + session + " of " + tenant + "? Its budgets and guard start over (the tenant's spend is kept).";
  if (!window.confirm(what)) return;
  try {
    await api(sessionPath(tenant, session) + "/" + action, { method: "POST" });
    showError("");
  } catch (err) {
    failed(err);
    return;
  }
  await refresh();
}

// --- start ------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("token").value = "";
    showError("");
    startPolling();
  });
  $("logout").addEventListener("click", () => loggedOut(""));
  $("trace-close").addEventListener("click", () => {
    openTrace = null;
    $("trace-panel").hidden = true;
  });
  $("filters").addEventListener("change", () => refresh());
  $("filters").addEventListener("submit", (event) => event.preventDefault());
  if (token()) startPolling();
  else loggedOut("");
});
