// The pgfence console: reads /console/api/* (read-only) and draws the audit views.
// Every value is put in the page as text (never as markup). Credentials: ?user=NAME sends the
// development header X-Pgfence-User (pgfence serve --demo / --dev-trusted-header); otherwise a
// bearer token kept in sessionStorage.

const params = new URLSearchParams(location.search);
const page = document.getElementById("page");
const status = document.getElementById("status");
let data = null;

function headers() {
  const h = {};
  if (params.get("user")) h["X-Pgfence-User"] = params.get("user");
  const token = sessionStorage.getItem("pgfence:console-token");
  if (token) h["Authorization"] = "Bearer " + token;
  return h;
}

async function get(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 10000);
  try {
    const resp = await fetch(path, {headers: headers(), signal: ctl.signal, cache: "no-store"});
    const body = await resp.json();
    if (resp.status === 401) document.getElementById("auth").hidden = false;
    if (!resp.ok) throw new Error(`${resp.status} ${body.error}: ${body.message}`);
    return body;
  } finally {
    clearTimeout(timer);
  }
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function cell(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

function table(rows, cols, empty) {
  if (!rows.length) return el("p", {class: "empty"}, empty);
  const t = el("table");
  t.append(el("tr", {}, ...cols.map((c) => el("th", {}, c))));
  for (const r of rows) t.append(el("tr", {}, ...cols.map((c) => el("td", {}, cell(r[c])))));
  return t;
}

function chart(queue, rows, now) {
  // 60 bars: items finished per minute over the last hour (done above, failed in red).
  const ns = "http://www.w3.org/2000/svg";
  const end = new Date(now); end.setSeconds(0, 0);
  const byMinute = new Map(rows.map((r) => [new Date(r.minute).getTime(), r]));
  const values = [];
  for (let i = 59; i >= 0; i--) {
    const r = byMinute.get(end.getTime() - i * 60000);
    values.push({done: r ? r.done : 0, failed: r ? r.failed : 0});
  }
  const top = Math.max(1, ...values.map((v) => v.done + v.failed));
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", "300"); svg.setAttribute("height", "60");
  values.forEach((v, i) => {
    const h = Math.round(56 * v.done / top), f = Math.round(56 * v.failed / top);
    for (const [height, y, color] of [[h, 58 - h, "#3d6fd8"], [f, 58 - h - f, "#c8432b"]]) {
      if (!height) continue;
      const bar = document.createElementNS(ns, "rect");
      bar.setAttribute("x", String(i * 5)); bar.setAttribute("y", String(y));
      bar.setAttribute("width", "4"); bar.setAttribute("height", String(height));
      bar.setAttribute("fill", color);
      svg.append(bar);
    }
  });
  const total = values.reduce((a, v) => a + v.done + v.failed, 0);
  return el("div", {class: "chart", "data-queue": queue},
            el("div", {class: "title"}, `${queue}: ${total} finished in the last hour`), svg);
}

const PAGES = {
  queues() {
    const box = el("div");
    const unserved = data.queues.filter((q) => q.unserved);
    box.append(el("p", {class: unserved.length || data.stuck.length ? "warn" : "ok"},
      unserved.length || data.stuck.length
        ? `${data.stuck.length} stuck, ${unserved.length} queue(s) with ready work and no live executor`
        : "healthy: nothing stuck, every queue with work is served"));
    box.append(table(data.queues, ["module", "queue", "ready", "deferred", "in_flight", "lapsed",
      "oldest_ready_age", "per_second_1m", "per_second_5m", "per_second_15m", "failed", "dead",
      "executors", "unserved"], "no items"));
    box.append(el("h3", {}, "finished per minute, last hour"));
    for (const q of data.queues) {
      const key = `${q.module} ${q.queue}`;
      box.append(chart(key, data.rates.filter((r) => r.module === q.module && r.queue === q.queue),
                       data.now));
    }
    return box;
  },
  stuck() {
    return table(data.stuck, ["module", "item_id", "queue", "status", "owner", "fence",
      "expired_at", "overdue", "next"], "nothing stuck");
  },
  duplicates() {
    return table(data.duplicates, ["module", "item_id", "queue", "status", "reason", "fences",
      "lost_by", "idempotency_key", "since", "check_downstream"], "no possible duplicates");
  },
  executors() {
    return table(data.executors, ["worker", "status", "modules", "serves", "host", "pid",
      "concurrency", "version", "started_at", "last_seen_at"], "no executor registered");
  },
  async timeline(module, id) {
    const box = el("div");
    const form = el("form", {id: "timeline-form"},
      el("select", {id: "tl-module"}, ...["outbox", "plan", "operation", "document"].map(
        (m) => { const o = el("option", {value: m}, m); if (m === module) o.selected = true; return o; })),
      " id ", el("input", {id: "tl-id", size: "8", value: id || ""}), " ", el("button", {}, "show"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      location.hash = `#timeline/${form.querySelector("#tl-module").value}/${form.querySelector("#tl-id").value}`;
    });
    box.append(form);
    if (module && id) {
      const t = await get(`api/timeline/${encodeURIComponent(module)}/${encodeURIComponent(id)}`);
      box.append(el("h3", {}, `${module}#${id}`));
      box.append(table(t.owner ? [t.owner] : [], Object.keys(t.owner || {}), "no owner row"));
      box.append(table(t.events, ["at", "event", "from_status", "to_status", "actor", "fence",
        "detail"], "no events"));
    }
    return box;
  },
};

async function render() {
  const [name, ...rest] = (location.hash.slice(1) || "queues").split("/");
  for (const a of document.querySelectorAll("nav a"))
    a.classList.toggle("active", a.dataset.page === name);
  try {
    data = await get("api/overview");
    const content = await (PAGES[name] || PAGES.queues)(...rest);
    page.replaceChildren(el("h2", {}, name), content);
    status.textContent = `as of ${data.now}`;
    document.body.dataset.ready = name;
  } catch (err) {
    page.replaceChildren(el("p", {class: "warn"}, String(err.message || err)));
    status.textContent = "error";
    document.body.dataset.ready = "error";
  }
}

document.getElementById("use-token").addEventListener("click", () => {
  sessionStorage.setItem("pgfence:console-token", document.getElementById("token").value);
  document.getElementById("auth").hidden = true;
  render();
});
window.addEventListener("hashchange", render);
render();
setInterval(() => { if (!location.hash.startsWith("#timeline")) render(); }, 5000);
