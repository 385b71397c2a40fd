// The demo page of `pgfence serve --demo`: a record editor and a small sheet grid on
// pgfence-documents.js. The server trusts the X-Pgfence-User header (development mode).
import { DocumentSession, MergeConflict, createDocument } from "./pgfence-documents.js";

const params = new URLSearchParams(location.search);
const user = params.get("user") || "ann";
const headers = { "X-Pgfence-User": user };
const COLS = ["A", "B", "C"], ROWS = [1, 2, 3, 4];
const show = (v) => (v === undefined ? "—" : JSON.stringify(v));
// Names and values come from other users: they go into the page as text, never as markup.
const el = (tag, text = "", attrs = {}) => Object.assign(document.createElement(tag), { textContent: text }, attrs);

document.getElementById("who").textContent = `editing as ${user}`;
const other = new URLSearchParams(params);
other.set("user", user === "ann" ? "bob" : "ann");

async function documents() {
  let record = Number(params.get("record")), sheet = Number(params.get("sheet"));
  if (!record) record = await createDocument("record", { title: "Q3 plan", owner: "ann", budget: 100, notes: "" }, { headers });
  if (!sheet) sheet = await createDocument("sheet", { A1: "1", B1: "2", C1: "=A1+B1" }, { headers });
  params.set("record", record); params.set("sheet", sheet); other.set("record", record); other.set("sheet", sheet);
  history.replaceState(null, "", `?${params}`);
  document.getElementById("other-user").href = `?${other}`;
  return { record, sheet };
}

class Panel {
  constructor(root, session, { read, write }) {
    Object.assign(this, { root, session, read, write });
    this.badge = root.querySelector(".badge");
    this.conflictBox = root.querySelector(".conflict-box");
    this.draftsBox = root.querySelector(".drafts-box");
    this.logBox = root.querySelector(".log");
    root.querySelector(".docid").textContent = `#${session.documentId}`;
    root.addEventListener("input", () => this.act(() => session.edit(this.read())));
    root.querySelector('[data-act="flush"]').onclick = () => this.act(() => session.flush(10000));
    root.querySelector('[data-act="reload"]').onclick = () => this.act(async () => {
      if (await session.discardAndReload()) this.write(session.content);
    });
    session.addEventListener("state", (e) => this.render(e.detail));
    for (const t of ["saved", "conflict", "error"]) {
      session.addEventListener(t, (e) => this.log(`${t}: ${t === "error" ? e.detail.error.message : JSON.stringify(e.detail)}`));
    }
    this.write(session.content);
    this.render(session.snapshot());
    this.renderDrafts();
    setInterval(() => { if (session.state === "clean") session.refresh().then((took) => took && this.write(session.content), () => {}); }, 2000);
  }

  log(text) {
    const line = document.createElement("div");
    line.textContent = `${new Date().toLocaleTimeString()} ${text}`;
    this.logBox.prepend(line);
  }

  async act(fn) {
    try { await fn(); } catch (err) { this.log(`${err.name}: ${err.message}`); }
  }

  render(snap) {
    this.badge.textContent = snap.state;
    this.badge.className = `badge ${snap.state}`;
    this.root.querySelector(".version").textContent = `v${snap.version}${snap.pending ? " + unsaved edits" : ""}`;
    if (snap.state !== "conflict") { this.conflictBox.classList.add("hidden"); return; }
    const c = snap.conflict;
    this.conflictBox.classList.remove("hidden");
    this.conflictBox.replaceChildren(el("b", "Conflict:"),
      ` you edited version ${c.baseVersion}; version ${c.storedVersion} was saved by ${c.storedBy}.`,
      el("br"));
    const rebase = this.button("Rebase (merge)", () => this.act(async () => {
      try { await this.session.rebase(); this.write(this.session.content); }
      catch (err) { if (err instanceof MergeConflict) this.choose(err.merged); else throw err; }
    }));
    const theirs = this.button("Take theirs", () => this.act(async () => {
      if (await this.session.discardAndReload()) this.write(this.session.content);
    }));
    const mine = this.button("Keep mine", () => this.act(async () => {
      await this.session.rebase(({ local }) => local); this.write(this.session.content);
    }));
    this.conflictBox.append(rebase, mine, theirs);
  }

  choose(merged) {
    const box = el("div");
    box.append(el("p", merged.content === null
      ? "A sheet never merges: keep your copy or take theirs."
      : "Both sides changed these; pick one per attribute:"));
    const picks = {};
    if (merged.content !== null) {
      for (const c of merged.conflicts) {
        const row = document.createElement("div");
        for (const side of ["local", "stored"]) {
          const radio = el("input", "", { type: "radio", name: `pick-${this.session.documentId}-${c.key}`,
                                         checked: side === "stored" });
          radio.dataset.side = side;
          const label = el("label", "", { style: "display:inline" });
          label.append(radio, ` ${c.key}: ${side === "local" ? "mine" : "theirs"} ${show(c[side])}`);
          row.append(label, " ");
          picks[c.key] = "stored";
        }
        row.addEventListener("change", (e) => { picks[c.key] = e.target.dataset.side; });
        box.append(row);
      }
      box.append(this.button("Save my choices", () => this.act(async () => {
        await this.session.rebase(({ merged: m, local }) => {
          const out = { ...m.content };
          for (const c of m.conflicts) {
            const v = picks[c.key] === "local" ? local[c.key] : c.stored;
            if (v === undefined) delete out[c.key]; else out[c.key] = v;
          }
          return out;
        });
        this.write(this.session.content);
      })));
    }
    this.conflictBox.append(box);
  }

  renderDrafts() {
    const drafts = this.session.siblingDrafts;
    this.draftsBox.classList.toggle("hidden", drafts.length === 0);
    this.draftsBox.replaceChildren(...(drafts.length ? [el("b", "Unsaved drafts from other tabs of yours:")] : []));
    for (const d of drafts) {
      const row = document.createElement("div");
      row.textContent = `based on v${d.baseVersion}, ${new Date(d.updatedAt).toLocaleTimeString()}: ${d.contentJson.slice(0, 80)} `;
      row.append(
        this.button("Adopt", () => this.act(async () => { await this.session.adopt(d); this.write(this.session.content); this.renderDrafts(); })),
        this.button("Discard", () => { this.session.discardDraft(d); this.renderDrafts(); }));
      this.draftsBox.append(row);
    }
  }

  button(text, onclick) {
    const b = document.createElement("button");
    b.textContent = text;
    b.onclick = onclick;
    return b;
  }
}

function recordPanel(session) {
  const root = document.getElementById("record");
  const fields = [...root.querySelectorAll("input[name]")];
  return new Panel(root, session, {
    read: () => Object.fromEntries(fields.map((f) => [f.name, f.name === "budget" && f.value !== "" && !isNaN(+f.value) ? +f.value : f.value])),
    write: (c) => { for (const f of fields) f.value = c[f.name] ?? ""; },
  });
}

function sheetPanel(session) {
  const root = document.getElementById("sheet");
  const grid = root.querySelector(".grid");
  grid.innerHTML = `<tr><th></th>${COLS.map((c) => `<th>${c}</th>`).join("")}</tr>` +
    ROWS.map((r) => `<tr><th>${r}</th>${COLS.map((c) => `<td><input data-cell="${c}${r}"></td>`).join("")}</tr>`).join("");
  const cells = [...grid.querySelectorAll("input")];
  return new Panel(root, session, {
    read: () => Object.fromEntries(cells.filter((i) => i.value !== "").map((i) => [i.dataset.cell, i.value])),
    write: (c) => { for (const i of cells) i.value = c[i.dataset.cell] ?? ""; },
  });
}

const ids = await documents();
const opts = { user, headers, debounceMs: 600 };
window.demo = {
  record: recordPanel(await DocumentSession.open(ids.record, opts)),
  sheet: sheetPanel(await DocumentSession.open(ids.sheet, opts)),
};
