"use strict";
// Tarn's console: plain DOM, no framework, nothing loaded from elsewhere.
// Every figure and action is a call to the admin API (/console/api/admin/…,
// root's sessions) or the S3 API (/console/api/s3/…, signed by the server as
// the session's access key); changes carry the session's CSRF token.

const state = { csrf: null, user: null, root: false, tab: null, timer: null, bucket: null, prefix: "", healBucket: "" };

const $ = (sel) => document.querySelector(sel);
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    // Through the CSSOM: the page's CSP refuses style attributes.
    else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const u = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${u[i]}`;
}
function duration(s) {
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${String(Math.floor(s % 86400 / 3600)).padStart(2, "0")}h`;
}
const stateClass = (s) => "state-" + String(s || "").replace(/ .*/, "").replace(/[^a-z]/g, "-");
function bar(frac) {
  const f = Math.max(0, Math.min(1, frac || 0));
  return el("div", { class: "bar", title: `${Math.round(f * 100)}%` }, el("div", { style: `width:${(f * 100).toFixed(1)}%` }));
}
function status(msg, bad) {
  const s = $("#status-line");
  s.textContent = msg || "";
  s.className = bad ? "error" : "";
}

async function call(method, path, body, headers) {
  const h = Object.assign({}, headers || {});
  if (method !== "GET" && method !== "HEAD") h["X-Tarn-CSRF"] = state.csrf;
  const r = await fetch(path, { method, headers: h, body, credentials: "same-origin" });
  if (r.status === 401 && path.startsWith("/console/api/")) {
    showLogin("The session ended: log in again.");
    throw new Error("not logged in");
  }
  return r;
}
async function admin(method, path, body) {
  const r = await call(method, "/console/api/admin" + path, body);
  const text = await r.text();
  let v = null;
  try { v = text ? JSON.parse(text) : null; } catch (_) { v = text; }
  if (!r.ok) throw new Error((v && v.error) || text || r.statusText);
  return v;
}
// S3: the answer's XML as a document; an S3 error becomes an Error with its
// code and message.
async function s3(method, path, body, headers) {
  const r = await call(method, "/console/api/s3" + path, body, headers);
  const text = method === "HEAD" ? "" : await r.text();
  const doc = text ? new DOMParser().parseFromString(text, "application/xml") : null;
  if (!r.ok) {
    const code = doc && doc.querySelector("Code") ? doc.querySelector("Code").textContent : r.status;
    const msg = doc && doc.querySelector("Message") ? doc.querySelector("Message").textContent : r.statusText;
    const e = new Error(`${code}: ${msg}`);
    e.code = code;
    throw e;
  }
  return { doc, text, response: r };
}
const xmlText = (node, name) => { const n = node.getElementsByTagName(name)[0]; return n ? n.textContent : ""; };
const enc = (key) => key.split("/").map(encodeURIComponent).join("/");

// ---- login ---------------------------------------------------------------

function showLogin(msg) {
  clearInterval(state.timer);
  state.csrf = null;
  $("#login").hidden = false;
  $("#view").hidden = true;
  $("#tabs").hidden = true;
  $("#logout").hidden = true;
  $("#who").textContent = "";
  $("#login-error").textContent = msg || "";
}

function loggedIn(s) {
  state.csrf = s.csrf;
  state.user = s.user;
  state.root = s.root;
  $("#login").hidden = true;
  $("#view").hidden = false;
  $("#tabs").hidden = false;
  $("#logout").hidden = false;
  $("#who").textContent = `${s.user} (${s.access_key})`;
  for (const a of document.querySelectorAll("#tabs a")) a.hidden = a.hasAttribute("data-root") && !s.root;
  const wanted = location.hash.slice(1);
  const allowed = [...document.querySelectorAll("#tabs a")].filter((a) => !a.hidden).map((a) => a.dataset.tab);
  show(allowed.includes(wanted) ? wanted : allowed[0]);
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target;
  const r = await fetch("/console/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ access_key: f.access_key.value.trim(), secret_key: f.secret_key.value }),
    credentials: "same-origin",
  });
  const v = await r.json().catch(() => ({}));
  if (!r.ok) { $("#login-error").textContent = v.error || r.statusText; return; }
  f.secret_key.value = "";
  loggedIn(v);
});

$("#logout").addEventListener("click", async () => {
  await fetch("/console/logout", { method: "POST", headers: { "X-Tarn-CSRF": state.csrf }, credentials: "same-origin" });
  showLogin("Logged out.");
});

for (const a of document.querySelectorAll("#tabs a")) {
  a.addEventListener("click", (ev) => { ev.preventDefault(); show(a.dataset.tab); });
}

async function show(tab) {
  clearInterval(state.timer);
  state.tab = tab;
  history.replaceState(null, "", "#" + tab);
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === tab);
  const view = $("#view");
  const render = VIEWS[tab];
  const run = async () => {
    try {
      const content = await render();
      if (state.tab !== tab) return;
      view.replaceChildren(...[content].flat());
      status(`updated ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      if (e.message !== "not logged in") status(e.message, true);
    }
  };
  view.replaceChildren(el("p", { class: "muted" }, "Loading…"));
  await run();
  // A refresh waits while someone types into the view.
  const typing = () => view.contains(document.activeElement) && /^(INPUT|TEXTAREA|SELECT)$/.test(document.activeElement.tagName);
  if (REFRESH[tab]) state.timer = setInterval(() => { if (!typing()) run(); }, REFRESH[tab]);
}

// ---- views ---------------------------------------------------------------

async function overview() {
  const st = await admin("GET", "/status");
  const d = st.drives;
  const cap = st.capacity;
  const cards = [
    ["Health", el("span", { class: stateClass(st.health), id: "health" }, st.health)],
    ["Drives", `${d.online} of ${d.total} online`],
    ["Capacity", cap.total_bytes ? `${bytes(cap.used_bytes)} of ${bytes(cap.total_bytes)}` : "-"],
    ["Free", bytes(cap.free_bytes)],
    ["Buckets", st.buckets],
    ["Jobs running", st.jobs_running],
    ["Under-replicated", st.under_replicated],
    ["Up", `${duration(st.uptime_seconds)} · ${st.version} · ${st.mode}`],
  ];
  if (st.cluster) cards.push(["Cluster", `${st.cluster.nodes_live} of ${st.cluster.nodes} nodes live · epoch ${st.cluster.epoch}`]);
  const out = [
    el("h1", {}, "Overview"),
    el("div", { class: "cards" }, cards.map(([k, v]) => el("div", { class: "card" }, el("div", { class: "label" }, k), el("div", { class: "value" }, v)))),
  ];
  if (cap.total_bytes) out.push(el("h2", {}, "Capacity used"), bar(cap.used_bytes / cap.total_bytes));
  if (st.problems.length) out.push(el("h2", {}, "Problems"), el("ul", {}, st.problems.map((p) => el("li", { class: "error" }, p))));
  return out;
}

async function drives() {
  const list = await admin("GET", "/drives");
  const rows = list.map((d) => el("tr", {},
    el("td", {}, d.set),
    el("td", { class: stateClass(d.state) }, d.state),
    el("td", {}, d.path),
    el("td", {}, bytes(d.used_bytes)), el("td", {}, bytes(d.free_bytes)), el("td", {}, bytes(d.total_bytes)),
    el("td", {}, d.total_bytes ? bar(d.used_bytes / d.total_bytes) : "-"),
    el("td", { class: "muted" }, d.reason || "")));
  const out = [el("h1", {}, "Drives"), el("table", { id: "drives" },
    el("tr", {}, ["Set", "State", "Drive", "Used", "Free", "Size", "", "Reason"].map((h) => el("th", {}, h))), rows)];
  const st = await admin("GET", "/status");
  if (st.cluster) {
    const cs = await admin("GET", "/cluster/status");
    out.push(el("h2", {}, "Nodes"), el("table", {},
      el("tr", {}, ["Node", "Live", "State", "S3", "Drives"].map((h) => el("th", {}, h))),
      (cs.nodes || []).map((n) => el("tr", {}, el("td", {}, n.id), el("td", { class: n.live ? "state-online" : "state-offline" }, n.live ? "live" : "DOWN"),
        el("td", {}, n.state), el("td", {}, n.s3 || ""), el("td", {}, (n.drives || []).length)))));
    for (const p of cs.pools || []) {
      out.push(el("h2", {}, `Pool ${p.id} (${p.state}): ${p.data_shards}+${p.parity_shards}`), el("table", {},
        el("tr", {}, el("th", {}, "Set"), el("th", {}, "Drives (node/drive)")),
        (p.sets || []).map((set, i) => el("tr", {}, el("td", {}, i), el("td", {}, set.map((x) => `${x.node}/${String(x.drive).slice(0, 8)}`).join("  "))))));
    }
  }
  return out;
}

function chart(title, points, series, fmt) {
  const W = 380, H = 180, L = 54, B = 20, T = 22;
  const xs = points.map((p) => p.unix_ms);
  const all = series.flatMap(([key]) => points.map((p) => p[key]).filter((v) => v !== null && v !== undefined));
  const max = Math.max(1e-9, ...all) * 1.1;
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? xs[xs.length - 1] : 1;
  const X = (t) => L + (W - L - 8) * (x1 > x0 ? (t - x0) / (x1 - x0) : 1);
  const Y = (v) => H - B - (H - B - T) * (v / max);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
  };
  add("text", { x: 8, y: 14, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, title);
  add("line", { x1: L, y1: H - B, x2: W - 8, y2: H - B, class: "axis" });
  add("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" });
  add("text", { x: 4, y: T + 8 }, fmt(max / 1.1));
  add("text", { x: 4, y: H - B }, fmt(0));
  add("text", { x: L, y: H - 4 }, xs.length ? new Date(x0).toLocaleTimeString() : "no data yet");
  const colors = ["#2456d6", "#c0262d", "#13804b"];
  series.forEach(([key, label], i) => {
    const pts = points.filter((p) => p[key] !== null && p[key] !== undefined).map((p) => `${X(p.unix_ms).toFixed(1)},${Y(p[key]).toFixed(1)}`);
    if (pts.length) add("polyline", { points: pts.join(" "), fill: "none", stroke: colors[i], "stroke-width": 1.5 });
    add("text", { x: W - 120, y: 14 + 12 * i, fill: colors[i] }, label);
  });
  return svg;
}

async function activity() {
  const s = await fetch("/console/api/series", { credentials: "same-origin" });
  if (s.status === 401) { showLogin("The session ended: log in again."); throw new Error("not logged in"); }
  const { points, every_s } = await s.json();
  const mb = (v) => `${(v / 1e6).toFixed(1)} MB/s`;
  return [
    el("h1", {}, "Activity (last 15 minutes)"),
    el("p", { class: "muted" }, `S3 requests on this node, sampled every ${every_s} s.`),
    el("div", { class: "charts", id: "charts" },
      chart("Requests per second", points, [["requests_per_s", "requests"], ["errors_per_s", "5xx errors"]], (v) => v.toFixed(1)),
      chart("Throughput", points, [["bytes_in_per_s", "in"], ["bytes_out_per_s", "out"]], mb),
      chart("Latency", points, [["latency_p50_s", "p50"], ["latency_p99_s", "p99"]], (v) => `${(v * 1000).toFixed(1)} ms`)),
  ];
}

async function jobs() {
  const { jobs } = await admin("GET", "/jobs");
  // Kept across the view's refreshes (every 2 s).
  const bucket = el("input", { placeholder: "bucket (empty: all)", id: "heal-bucket", value: state.healBucket || "",
    oninput: (ev) => { state.healBucket = ev.target.value; } });
  const start = el("button", { class: "primary", id: "heal-start", onclick: async () => {
    try {
      const q = bucket.value.trim() ? `?bucket=${encodeURIComponent(bucket.value.trim())}` : "";
      const j = await admin("POST", "/heal/jobs" + q);
      status(j.started ? `heal job ${j.id} started` : `heal job ${j.id} already covers this`);
      show("jobs");
    } catch (e) { status(e.message, true); }
  } }, "Start a heal");
  const rows = jobs.map((j) => {
    let frac = null, progress = "", detail = "";
    if (j.kind === "heal" || j.kind === "prefetch" || j.kind === "backfill") {
      frac = j.objects_total ? j.objects_done / j.objects_total : (j.state === "running" ? 0 : 1);
      progress = `${j.objects_done}/${j.objects_total} objects`;
      detail = j.kind === "heal" ? `${j.phase}; ${j.objects_healed} healed, ${j.failures} failed${j.bucket ? "; bucket " + j.bucket : ""}`
        : j.kind === "prefetch" ? `bucket ${j.bucket}; ${bytes(j.bytes_done)} of ${bytes(j.bytes_total)}`
        : `${j.phase || ""} on ${j.node || ""}`;
    } else if (j.kind === "drain") {
      progress = `${j.moved} keys moved`;
      detail = `pool ${j.pool}, led by ${j.node}; ${j.keys_left} left in this pass`;
    } else if (j.kind === "lifecycle") {
      progress = `${j.passes} passes`;
      detail = `${j.versions_scanned} versions scanned, ${j.expired} expired, ${j.uploads_aborted} uploads aborted, ${j.errors} errors`;
    }
    return el("tr", {}, el("td", {}, j.id || j.kind), el("td", {}, j.kind), el("td", { class: stateClass(j.state || "running") }, j.state || "running"),
      el("td", {}, frac === null ? "" : bar(frac)), el("td", {}, progress), el("td", { class: "muted" }, detail));
  });
  return [el("h1", {}, "Jobs"), el("div", { class: "toolbar" }, bucket, start),
    el("table", { id: "jobs" }, el("tr", {}, ["ID", "Kind", "State", "", "Progress", "Detail"].map((h) => el("th", {}, h))), rows)];
}

function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-z_]+)(\{([^}]*)\})? (\S+)$/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[3] || "").matchAll(/([a-z_]+)="([^"]*)"/g)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

async function kv() {
  const r = await call("GET", "/console/api/admin/metrics");
  const ms = parseMetrics(await r.text());
  const tenants = {};
  for (const m of ms) {
    if (!m.name.startsWith("tarn_kv_") || !m.labels.tenant) continue;
    const t = (tenants[m.labels.tenant] ||= { stats: {}, ns: {} });
    if (m.name === "tarn_kv_namespace") ((t.ns[m.labels.namespace] ||= {})[m.labels.counter] = m.value);
    else if (m.name !== "tarn_kv_class") t.stats[m.name.slice(8)] = m.value;
  }
  const out = [el("h1", {}, "KV cache")];
  if (!Object.keys(tenants).length) {
    out.push(el("p", { class: "muted" }, "The KV store is not running on this node (tarn server --kv)."));
    return out;
  }
  for (const [tenant, t] of Object.entries(tenants)) {
    const s = t.stats;
    out.push(el("h2", {}, `Tenant ${tenant}`), el("div", { class: "cards" },
      el("div", { class: "card" }, el("div", { class: "label" }, "RAM tier"), el("div", { class: "value" }, `${bytes(s.ram_used_bytes)} of ${bytes(s.ram_capacity_bytes)}`), bar(s.ram_used_bytes / (s.ram_capacity_bytes || 1))),
      el("div", { class: "card" }, el("div", { class: "label" }, "Disk tier"), el("div", { class: "value" }, s.disk_capacity_bytes ? `${bytes(s.disk_used_bytes)} of ${bytes(s.disk_capacity_bytes)}` : "none"), s.disk_capacity_bytes ? bar(s.disk_used_bytes / s.disk_capacity_bytes) : null),
      el("div", { class: "card" }, el("div", { class: "label" }, "Blocks"), el("div", { class: "value" }, s.blocks ?? "-"))));
    out.push(el("table", { class: "kv-namespaces" }, el("tr", {}, ["Namespace", "Gets", "Hit rate", "RAM hits", "Disk hits", "Misses", "Blocks", "Read", "Written"].map((h) => el("th", {}, h))),
      Object.entries(t.ns).map(([ns, c]) => {
        const hits = (c.hits_ram || 0) + (c.hits_disk || 0);
        const misses = (c.misses_not_found || 0) + (c.misses_corrupt || 0) + (c.misses_no_space || 0) + (c.misses_not_owner || 0);
        return el("tr", {}, el("td", {}, ns), el("td", {}, c.gets || 0), el("td", {}, c.gets ? `${(100 * hits / c.gets).toFixed(1)}%` : "-"),
          el("td", {}, c.hits_ram || 0), el("td", {}, c.hits_disk || 0), el("td", {}, misses), el("td", {}, c.blocks || 0),
          el("td", {}, bytes(c.bytes_read || 0)), el("td", {}, bytes(c.bytes_written || 0)));
      })));
  }
  return out;
}

async function bucketList() {
  const { doc } = await s3("GET", "/");
  const names = [...doc.getElementsByTagName("Bucket")].map((b) => ({ name: xmlText(b, "Name"), created: xmlText(b, "CreationDate") }));
  const input = el("input", { placeholder: "new bucket name", id: "new-bucket" });
  const create = el("button", { class: "primary", id: "create-bucket", onclick: async () => {
    try { await s3("PUT", "/" + encodeURIComponent(input.value.trim())); status(`bucket ${input.value.trim()} created`); show("buckets"); }
    catch (e) { status(e.message, true); }
  } }, "Create bucket");
  const rows = names.map((b) => el("tr", {},
    el("td", {}, el("a", { class: "crumb", href: "#buckets", "data-bucket": b.name, onclick: (ev) => { ev.preventDefault(); openBucket(b.name, ""); } }, b.name)),
    el("td", { class: "muted" }, b.created),
    el("td", {}, el("button", { class: "danger", onclick: async () => {
      if (!confirm(`Delete bucket ${b.name}? It must be empty.`)) return;
      try { await s3("DELETE", "/" + encodeURIComponent(b.name)); status(`bucket ${b.name} deleted`); show("buckets"); }
      catch (e) { status(e.message, true); }
    } }, "Delete"))));
  return [el("h1", {}, "Buckets"), el("div", { class: "toolbar" }, input, create),
    el("table", { id: "buckets" }, el("tr", {}, ["Bucket", "Created", ""].map((h) => el("th", {}, h))), rows)];
}

async function buckets() {
  if (state.bucket !== null) return bucketView(state.bucket, state.prefix);
  return bucketList();
}

function openBucket(name, prefix) {
  state.bucket = name;
  state.prefix = prefix;
  show("buckets");
}

async function bucketView(bucket, prefix) {
  const b = "/" + encodeURIComponent(bucket);
  const q = `?list-type=2&delimiter=%2F&prefix=${encodeURIComponent(prefix)}`;
  const { doc } = await s3("GET", b + q);
  const dirs = [...doc.getElementsByTagName("CommonPrefixes")].map((p) => xmlText(p, "Prefix"));
  const objects = [...doc.getElementsByTagName("Contents")].map((o) => ({ key: xmlText(o, "Key"), size: Number(xmlText(o, "Size")), modified: xmlText(o, "LastModified") }));
  const crumbs = [el("a", { class: "crumb", onclick: () => { state.bucket = null; show("buckets"); } }, "Buckets"), " / ",
    el("a", { class: "crumb", onclick: () => openBucket(bucket, "") }, bucket)];
  let acc = "";
  for (const part of prefix.split("/").filter(Boolean)) {
    acc += part + "/";
    const p = acc;
    crumbs.push(" / ", el("a", { class: "crumb", onclick: () => openBucket(bucket, p) }, part));
  }
  const file = el("input", { type: "file", id: "upload-file", multiple: true });
  const upload = el("button", { class: "primary", id: "upload", onclick: async () => {
    for (const f of file.files) {
      try {
        status(`uploading ${f.name} (${bytes(f.size)})…`);
        await s3("PUT", `${b}/${enc(prefix + f.name)}`, f, { "Content-Type": f.type || "application/octet-stream" });
        status(`uploaded ${f.name}`);
      } catch (e) { status(`${f.name}: ${e.message}`, true); return; }
    }
    openBucket(bucket, prefix);
  } }, "Upload");
  const rows = [
    ...dirs.map((d) => el("tr", {}, el("td", {}, el("a", { class: "crumb", onclick: () => openBucket(bucket, d) }, d.slice(prefix.length))), el("td", {}, ""), el("td", {}, ""), el("td", {}, ""))),
    ...objects.map((o) => el("tr", {},
      el("td", {}, el("a", { href: `/console/api/s3${b}/${enc(o.key)}`, download: o.key.split("/").pop(), "data-key": o.key }, o.key.slice(prefix.length))),
      el("td", {}, bytes(o.size)), el("td", { class: "muted" }, o.modified),
      el("td", {}, el("button", { class: "danger", onclick: async () => {
        if (!confirm(`Delete ${o.key}?`)) return;
        try { await s3("DELETE", `${b}/${enc(o.key)}`); status(`deleted ${o.key}`); openBucket(bucket, prefix); }
        catch (e) { status(e.message, true); }
      } }, "Delete")))),
  ];
  const out = [el("h1", {}, crumbs), el("div", { class: "toolbar" }, file, upload),
    el("table", { id: "objects" }, el("tr", {}, ["Name", "Size", "Modified", ""].map((h) => el("th", {}, h))), rows)];
  if (xmlText(doc, "IsTruncated") === "true") out.push(el("p", { class: "muted" }, "More objects than one page: narrow the prefix."));
  out.push(...await bucketSettings(bucket));
  return out;
}

// Versioning, policy and lifecycle: each read and written as S3 has them.
async function bucketSettings(bucket) {
  const b = "/" + encodeURIComponent(bucket);
  const out = [el("h2", {}, "Settings")];
  try {
    const { doc } = await s3("GET", b + "?versioning");
    const cur = xmlText(doc, "Status") || "Off";
    const sel = el("select", { id: "versioning" }, ["Enabled", "Suspended"].map((v) => el("option", { value: v, selected: v === cur }, v)));
    out.push(el("div", { class: "toolbar" }, `Versioning: ${cur}`, sel, el("button", { onclick: async () => {
      const body = `<VersioningConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Status>${sel.value}</Status></VersioningConfiguration>`;
      try { await s3("PUT", b + "?versioning", body, { "Content-Type": "application/xml" }); status(`versioning ${sel.value}`); openBucket(bucket, state.prefix); }
      catch (e) { status(e.message, true); }
    } }, "Set")));
  } catch (e) { out.push(el("p", { class: "muted" }, `Versioning: ${e.message}`)); }
  const editor = async (title, query, empty, type) => {
    let text = "";
    try { text = (await s3("GET", b + query)).text; }
    catch (e) { if (!String(e.code).startsWith("NoSuch")) return [el("p", { class: "muted" }, `${title}: ${e.message}`)]; }
    const area = el("textarea", { id: `edit-${query.slice(1)}`, placeholder: empty }, text);
    return [el("h2", {}, title), area, el("div", { class: "toolbar" },
      el("button", { class: "primary", onclick: async () => {
        try { await s3("PUT", b + query, area.value, { "Content-Type": type }); status(`${title} saved`); }
        catch (e) { status(e.message, true); }
      } }, "Save"),
      el("button", { class: "danger", onclick: async () => {
        try { await s3("DELETE", b + query); area.value = ""; status(`${title} removed`); }
        catch (e) { status(e.message, true); }
      } }, "Remove"))];
  };
  out.push(...await editor("Bucket policy (JSON)", "?policy", '{"Version": "2012-10-17", "Statement": [...]}', "application/json"));
  out.push(...await editor("Lifecycle (XML)", "?lifecycle", "<LifecycleConfiguration>…</LifecycleConfiguration>", "application/xml"));
  return out;
}

async function users() {
  const { users } = await admin("GET", "/users");
  const name = el("input", { placeholder: "new user name", id: "new-user" });
  const shown = el("div", { id: "new-secret" });
  // Into the page as it is after the table is drawn again.
  const reveal = (k) => $("#new-secret").replaceChildren(el("div", { class: "secret" },
    `user ${k.user}: access key ${k.access_key}, secret key `, el("b", {}, k.secret_key), " (shown only now)"));
  const add = el("button", { class: "primary", id: "add-user", onclick: async () => {
    try { const k = await admin("POST", "/users/" + encodeURIComponent(name.value.trim())); await show("users"); reveal(k); }
    catch (e) { status(e.message, true); }
  } }, "Create user");
  const rows = users.map((u) => el("tr", { "data-user": u.name },
    el("td", {}, u.name),
    el("td", {}, (u.access_keys || []).map((k) => el("div", {}, k, " ", u.name === "root" ? null : el("button", { class: "danger", "data-revoke": k, onclick: async () => {
      if (!confirm(`Revoke access key ${k} of ${u.name}?`)) return;
      try { await admin("DELETE", `/users/${encodeURIComponent(u.name)}/keys/${encodeURIComponent(k)}`); status(`revoked ${k}`); show("users"); }
      catch (e) { status(e.message, true); }
    } }, "Revoke")))),
    el("td", {}, u.name === "root" ? null : [
      el("button", { onclick: async () => {
        try { const k = await admin("POST", `/users/${encodeURIComponent(u.name)}/keys`); await show("users"); reveal(k); }
        catch (e) { status(e.message, true); }
      } }, "Add key"), " ",
      el("button", { class: "danger", onclick: async () => {
        if (!confirm(`Remove user ${u.name} and all its keys?`)) return;
        try { await admin("DELETE", `/users/${encodeURIComponent(u.name)}`); status(`removed ${u.name}`); show("users"); }
        catch (e) { status(e.message, true); }
      } }, "Remove")])));
  return [el("h1", {}, "Users and access keys"), el("div", { class: "toolbar" }, name, add), shown,
    el("table", { id: "users" }, el("tr", {}, ["User", "Access keys", ""].map((h) => el("th", {}, h))), rows),
    el("p", { class: "muted" }, "What a user may do is set by bucket policies (Buckets → a bucket → Bucket policy).")];
}

// Cache buckets over upstream S3 buckets: settings, figures, pins and the
// actions of `tarn admin cache` (the same /admin/cache API).
async function cache() {
  const [list, stats, jobs] = await Promise.all([admin("GET", "/cache/buckets"), admin("GET", "/cache/status"), admin("GET", "/cache/jobs")]);
  const byName = Object.fromEntries(stats.map((s) => [s.bucket, s]));
  const act = (name, action, body, done) => async () => {
    try {
      const v = await admin("POST", `/cache/buckets/${encodeURIComponent(name)}/${action}`, JSON.stringify(body));
      await show("cache");
      status(done(v));
    } catch (e) { status(e.message, true); }
  };
  const out = [el("h1", {}, "Cache buckets")];
  if (!list.length) out.push(el("p", { class: "muted" }, "No cache buckets: a cache bucket serves an upstream S3 bucket's objects from Tarn's drives, fetched on first read."));
  for (const b of list) {
    const s = byName[b.bucket] || {};
    const prefix = el("input", { placeholder: "prefix (empty: everything)", "data-cache-prefix": b.bucket });
    const p = () => prefix.value.trim();
    out.push(el("h2", { "data-cache": b.bucket }, b.bucket),
      el("table", { class: "settings" },
        ...[["Upstream", `${b.upstream} at ${b.endpoint}`], ["Validation", b.validate], ["Writes", b.writes],
          ["Cached", s.usage ? `${bytes(s.usage.bytes_cached)} in ${s.usage.objects_cached} objects, of ${b.size ? bytes(b.size) : "the node's cache budget"}` : "-"], ["Hit ratio", s.hits + s.misses ? `${(s.hit_ratio * 100).toFixed(1)}% (${s.hits} hits, ${s.misses} misses)` : "-"],
          ["Served", `${bytes(s.bytes_served)}, ${bytes(s.bytes_from_upstream)} from upstream`], ["Evicted", `${s.evictions || 0} (${bytes(s.bytes_evicted || 0)})`],
          ["Fills failed", s.fills_failed || 0], ["Replicas", b.replicas ?? "as the store's sets"],
          ["Pins", (s.pins || []).map((x) => (x.prefix || "(everything)") + (x.until_ns ? ` (until ${new Date(x.until_ns / 1e6).toLocaleString()})` : "")).join(", ") || "none"]]
          .map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)))),
      el("div", { class: "toolbar" }, prefix,
        el("button", { class: "primary", "data-prefetch": b.bucket, onclick: () => act(b.bucket, "prefetch", { prefix: p() }, (v) => `prefetch ${v.id} started`)() }, "Prefetch"),
        el("button", { onclick: () => act(b.bucket, "pin", { prefix: p() }, () => `pinned ${p() || "everything"}`)() }, "Pin"),
        el("button", { onclick: () => act(b.bucket, "unpin", { prefix: p() }, () => `unpinned ${p() || "everything"}`)() }, "Unpin"),
        el("button", { class: "danger", onclick: () => act(b.bucket, "drop", { prefix: p() }, (v) => `dropped ${v.objects_dropped} objects (${bytes(v.bytes_dropped)})`)() }, "Drop cached"),
        el("button", { class: "danger", onclick: async () => {
          if (!confirm(`Remove cache bucket ${b.bucket}? Its cached copies go; the upstream bucket is untouched.`)) return;
          try { await admin("DELETE", `/cache/buckets/${encodeURIComponent(b.bucket)}`); status(`removed ${b.bucket}`); show("cache"); }
          catch (e) { status(e.message, true); }
        } }, "Remove")));
  }
  if (jobs.length) {
    out.push(el("h2", {}, "Prefetches"), el("table", { id: "cache-jobs" },
      el("tr", {}, ["Job", "Bucket", "State", "Progress"].map((h) => el("th", {}, h))),
      jobs.map((j) => el("tr", {}, el("td", {}, j.id), el("td", {}, j.bucket || ""), el("td", { class: stateClass(j.state) }, `${j.kind || "prefetch"} ${j.state}`),
        el("td", {}, j.bytes_total ? bar((j.bytes_done || 0) / j.bytes_total) : `${j.objects_done || 0} objects`)))));
  }
  // A new cache bucket: what `tarn admin cache add` takes.
  const f = {};
  const field = (name, placeholder, type) => (f[name] = el("input", { placeholder, id: `cache-new-${name}`, type: type || "text" }));
  out.push(el("h2", {}, "New cache bucket"), el("div", { class: "toolbar" },
    field("bucket", "bucket name"), field("upstream", "s3://upstream-bucket[/prefix]"), field("endpoint", "https://upstream-endpoint"),
    field("region", "region (optional)"), field("access_key", "upstream access key (optional)"), field("secret_key", "upstream secret key", "password"),
    field("size", "size in bytes (optional)"),
    el("button", { class: "primary", id: "cache-add", onclick: async () => {
      const spec = { upstream: f.upstream.value.trim(), endpoint: f.endpoint.value.trim() };
      for (const k of ["region", "access_key", "secret_key"]) if (f[k].value.trim()) spec[k] = f[k].value.trim();
      if (f.size.value.trim()) spec.size = Number(f.size.value.trim());
      try { await admin("POST", `/cache/buckets/${encodeURIComponent(f.bucket.value.trim())}`, JSON.stringify(spec)); status(`cache bucket ${f.bucket.value.trim()} added`); show("cache"); }
      catch (e) { status(e.message, true); }
    } }, "Add")));
  return out;
}

const VIEWS = { overview, drives, activity, jobs, kv, cache, buckets, users };
const REFRESH = { overview: 5000, drives: 5000, activity: 5000, jobs: 2000, kv: 5000, cache: 5000 };

// A session that is still there (a reload) goes straight in.
fetch("/console/session", { credentials: "same-origin" }).then(async (r) => {
  if (r.ok) loggedIn(await r.json()); else showLogin("");
});
