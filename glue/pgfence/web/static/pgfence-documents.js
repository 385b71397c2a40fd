// pgfence-documents.js — the browser session of one versioned document (an ES module: no
// dependencies, no build step). Same contract as the Python session
// (pgfence.documents.DocumentSession); the server (`pgfence serve` or documents_app) decides
// every version and conflict:
//
//   - edit() replaces the local snapshot; saves are debounced (debounceMs after the last edit,
//     at most maxWaitMs after the first unsaved one) and serialised: one save in flight, always
//     of the latest snapshot, against the last confirmed version. An edit made during a save
//     stays pending; that save's success never clears it.
//   - A save whose answer was lost (network error, timeout, 408/429/502/503/504) is retried
//     with the same save id (Idempotency-Key), base version and content: the server answers
//     "saved" (replayed) if the first attempt committed. A refusal (other 4xx) is not retried
//     until the next edit; one refused 401 (expired credentials) also on the next flush.
//   - A 409 stops saving: state "conflict" with base, local and stored copies. No automatic
//     rebase: rebase(resolve) runs the kind's merge on the server (POST …/merge; records merge
//     by attribute id, sheets never merge) and saves the result against the stored version.
//   - Every edit is written to this writer's draft slot in localStorage, keyed by (scope, user,
//     document, writer id), before anything is sent; the draft is deleted only when the save
//     of exactly that snapshot succeeded or the user discarded it. Other writers' drafts are
//     offered (siblingDrafts: adopt or discardDraft), never applied silently. A writer id is
//     held with a Web Lock while its session lives: two live tabs never share one slot.
//   - Reads carry a sequence number and the edit generation at their start: an answer older
//     than an applied read, or that started before a local edit, is dropped.
//   - discardAndReload() fetches first and replaces local state only when that worked.
//   - pagehide / visibilitychange(hidden) send the pending save at once with fetch keepalive.
//   - state: clean | dirty | saving | conflict | error | offline | closed, as "state" events
//     (also "saved", "conflict", "error", "staleread").
//
// Example:
//   import { DocumentSession } from "/static/pgfence-documents.js";
//   const s = await DocumentSession.open(42, { user: "ann", headers: { Authorization: "Bearer …" } });
//   s.addEventListener("state", (e) => render(e.detail));
//   for (const d of s.siblingDrafts) offer(d);          // ask the person: adopt or discard
//   s.edit({ ...s.content, title: "Q3 plan" });
//   try { await s.flush(); } catch (e) { if (e instanceof ConflictPending) await s.rebase(); }

export const STATES = Object.freeze(["clean", "dirty", "saving", "conflict", "error", "offline",
                                     "closed"]);
const KEEPALIVE_MAX = 60000;   // fetch keepalive bodies are limited to 64 KiB in total

// -------------------------------------------------------------------------------------------
// errors
// -------------------------------------------------------------------------------------------
export class SessionError extends Error {
  constructor(message, options) { super(message, options); this.name = new.target.name; }
}
/** flush() cannot finish: the session is in conflict (see .conflict). */
export class ConflictPending extends SessionError {
  constructor(conflict) {
    super(`document save conflicts with stored version ${conflict.storedVersion} ` +
          `(saved by ${conflict.storedBy})`);
    this.conflict = conflict;
  }
}
/** flush() cannot finish: the server refused the save (.cause); not retried until the next edit. */
export class SaveRefused extends SessionError {}
/** rebase() without a resolver: the kind's merge left conflicts (.merged). */
export class MergeConflict extends SessionError {
  constructor(merged) {
    super(`the merge leaves ${merged.conflicts.length} conflict(s): ` +
          merged.conflicts.map((c) => String(c.key)).join(", "));
    this.merged = merged;
  }
}
/** The document was deleted on the server; the local copy and its draft are kept. */
export class DocumentDeleted extends SessionError {}
/** The operation needs a session without unsaved edits or conflict. */
export class SessionBusy extends SessionError {}
/** Local edits kept arriving while rebasing. */
export class StaleRead extends SessionError {}
/** The session is closed. */
export class SessionClosed extends SessionError {}
/** flush() did not finish in time. */
export class FlushTimeout extends SessionError {}
/** The draft slot no longer holds the snapshot the caller saw. */
export class DraftChanged extends SessionError {}
/** An HTTP error answer: .status, .body ({error, message, sqlstate, ...}). */
export class HttpError extends Error {
  constructor(status, body) {
    super(`HTTP ${status}: ${(body && (body.message || body.error)) || "error"}`);
    this.name = "HttpError";
    this.status = status;
    this.body = body || {};
    this.code = this.body.error;
    this.sqlstate = this.body.sqlstate;
  }
  /** 408/429/502/503/504: the outcome is unknown or the server asked for a retry. */
  get transient() { return [408, 429, 502, 503, 504].includes(this.status); }
}
/** No answer (network down, connection cut, timeout): the outcome is unknown. */
export class NetworkError extends Error {
  constructor(message, options) { super(message, options); this.name = "NetworkError"; }
}

// -------------------------------------------------------------------------------------------
// helpers
// -------------------------------------------------------------------------------------------
function newId() {
  if (globalThis.crypto && crypto.randomUUID) return crypto.randomUUID().replaceAll("-", "");
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

function dumps(content) {
  const text = JSON.stringify(content);
  if (text === undefined) throw new TypeError("content is not JSON-serialisable");
  return text;
}

/** JSON text with object keys sorted: equal values give equal text. */
function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  if (value && typeof value === "object") {
    return `{${Object.keys(value).sort().map((k) => `${JSON.stringify(k)}:${canonical(value[k])}`).join(",")}}`;
  }
  return JSON.stringify(value);
}

export function sameContent(a, b) { return canonical(a) === canonical(b); }

function now() { return performance.now(); }

/**
 * Hold the Web Lock `name` for as long as this page wants it: resolves with its release
 * function, or null when another live tab (or session) still holds it after waitMs (the wait
 * covers a reloading page whose old document is still letting go). Without Web Locks (a page
 * that is not a secure context) every claim succeeds: there is nothing to ask.
 */
function claimLock(name, waitMs = 300) {
  const locks = globalThis.navigator && navigator.locks;
  if (!locks) return Promise.resolve(() => {});
  return new Promise((resolve, reject) => {
    locks.request(name, { signal: AbortSignal.timeout(waitMs) },
                  () => new Promise((release) => resolve(release)))
      .catch((err) => (err && err.name === "TimeoutError" ? resolve(null) : reject(err)));
  });
}

/** A document id as a number: positive safe integers, or their decimal text ("42" = 42). */
function documentIdOf(value) {
  const id = typeof value === "string" && /^[1-9][0-9]{0,15}$/.test(value) ? Number(value) : value;
  if (!Number.isSafeInteger(id) || id < 1) {
    throw new TypeError(`documentId must be a positive integer, got ${JSON.stringify(value)}`);
  }
  return id;
}

/** A lock whose free acquisition is synchronous (so a pagehide handler can send at once). */
class Mutex {
  constructor() { this.held = false; this._queue = []; }
  tryLock() { if (this.held) return false; this.held = true; return true; }
  lock() { return this.tryLock() ? Promise.resolve() : new Promise((r) => this._queue.push(r)); }
  unlock() { const next = this._queue.shift(); if (next) next(); else this.held = false; }
}

// -------------------------------------------------------------------------------------------
// HTTP
// -------------------------------------------------------------------------------------------
/** The documents API at baseUrl (…/documents/{id}). */
export class DocumentsClient {
  /**
   * @param {string} baseUrl  where the API lives ("" = the server this module came from)
   * @param {object} opts  headers (object or function returning one), timeoutMs, fetch
   */
  constructor(baseUrl, { headers = {}, timeoutMs = 10000, fetch: fetchImpl } = {}) {
    this.baseUrl = new URL(baseUrl || new URL("../", import.meta.url).href, location.href).href
      .replace(/\/?$/, "/");
    this.headers = headers;
    this.timeoutMs = timeoutMs;
    this._fetch = fetchImpl || globalThis.fetch.bind(globalThis);
  }

  url(path) { return new URL(path, this.baseUrl).href; }

  // No await before fetch(): a pagehide handler's request is sent before the handler returns.
  async request(method, path, { body, headers = {}, keepalive = false, okStatuses = [] } = {}) {
    const extra = typeof this.headers === "function" ? this.headers() : this.headers;
    const init = { method, headers: { Accept: "application/json", ...extra, ...headers },
                   cache: "no-store", keepalive, signal: AbortSignal.timeout(this.timeoutMs) };
    if (body !== undefined) {
      init.body = body;
      init.headers["Content-Type"] = "application/json";
    }
    let res;
    try {
      res = await this._fetch(this.url(path), init);
    } catch (err) {
      throw new NetworkError(`${method} ${path}: no answer (${err && err.name}: ${err && err.message})`,
                             { cause: err });
    }
    let data = null;
    try {
      const text = await res.text();
      data = text ? JSON.parse(text) : null;
    } catch (err) {
      if (res.ok) throw new NetworkError(`${method} ${path}: the answer was cut`, { cause: err });
    }
    if (!res.ok && !okStatuses.includes(res.status)) throw new HttpError(res.status, data);
    return { status: res.status, body: data || {}, etag: res.headers.get("ETag") };
  }

  /** POST /documents → the new id. */
  async create(kind, content, { idempotencyKey } = {}) {
    const headers = idempotencyKey ? { "Idempotency-Key": idempotencyKey } : {};
    const r = await this.request("POST", "documents", { body: dumps({ kind, content }), headers });
    return r.body.id;
  }

  /** GET /documents/{id} → {id, kind, version, content, ...} or {deleted: true, version}. */
  async get(id) {
    const r = await this.request("GET", `documents/${id}`, { okStatuses: [410] });
    if (r.status === 410) return { id, deleted: true, version: r.body.version };
    return { ...r.body, deleted: false };
  }

  /** GET /documents/{id}/revisions/{version}. */
  async revision(id, version) {
    return (await this.request("GET", `documents/${id}/revisions/${version}`)).body;
  }

  /** PUT: {outcome: "saved", version, replayed} | {outcome: "conflict", version, content,
   *  savedBy, deleted}; other answers throw HttpError / NetworkError. */
  async save(id, expectedVersion, contentJson, saveId, { keepalive = false } = {}) {
    const r = await this.request("PUT", `documents/${id}`, {
      body: `{"content":${contentJson}}`, keepalive, okStatuses: [409, 410],
      headers: { "If-Match": `"${expectedVersion}"`, "Idempotency-Key": saveId },
    });
    if (r.status === 409 && r.body.error === "version_conflict") {
      return { outcome: "conflict", version: r.body.version, content: r.body.content,
               savedBy: r.body.saved_by, deleted: false };
    }
    if (r.status === 410) {
      return { outcome: "conflict", version: r.body.version, content: null,
               savedBy: r.body.saved_by, deleted: true };
    }
    if (r.status !== 200) throw new HttpError(r.status, r.body);
    return { outcome: "saved", version: r.body.version, replayed: !!r.body.replayed };
  }

  /** POST /documents/{id}/merge → {content, conflicts, clean}. */
  async merge(id, base, local, stored) {
    return (await this.request("POST", `documents/${id}/merge`,
                               { body: dumps({ base, local, stored }) })).body;
  }
}

/** Create a document; returns its id. opts: baseUrl, headers, idempotencyKey. */
export async function createDocument(kind, content, { baseUrl = "", headers = {},
                                                       idempotencyKey } = {}) {
  return new DocumentsClient(baseUrl, { headers }).create(kind, content, { idempotencyKey });
}

// -------------------------------------------------------------------------------------------
// drafts (localStorage)
// -------------------------------------------------------------------------------------------
/** Per-writer drafts: one slot per (scope, user, document, writer) in a Storage. */
export class DraftStore {
  constructor(storage = globalThis.localStorage, prefix = "pgfence:draft:") {
    this.storage = storage;
    this.prefix = prefix;
  }

  key(scope, user, documentId, writerId) {
    return this.prefix + JSON.stringify([scope, user, documentId, writerId]);
  }

  _slotPrefix(scope, user, documentId) {
    return this.prefix + JSON.stringify([scope, user, documentId]).slice(0, -1) + ",";
  }

  static _parse(text) {
    if (!text) return null;
    try {
      const d = JSON.parse(text);
      return Object.freeze({ ...d, content: JSON.parse(d.contentJson) });
    } catch { return null; }
  }

  /** Write a draft into its writer's slot (throws if the storage is full: the edit is not taken). */
  put(d) {
    const { content, ...plain } = d;
    this.storage.setItem(this.key(d.scope, d.user, d.documentId, d.writerId), JSON.stringify(plain));
  }

  get(scope, user, documentId, writerId) {
    return DraftStore._parse(this.storage.getItem(this.key(scope, user, documentId, writerId)));
  }

  /** Every draft of (scope, user, document), newest first. */
  list(scope, user, documentId) {
    const prefix = this._slotPrefix(scope, user, documentId);
    const out = [];
    for (let i = 0; i < this.storage.length; i++) {
      const k = this.storage.key(i);
      if (k && k.startsWith(prefix)) {
        const d = DraftStore._parse(this.storage.getItem(k));
        if (d) out.push(d);
      }
    }
    return out.sort((a, b) => b.updatedAt - a.updatedAt);
  }

  /** Empty a slot; with snapshotId only if it still holds that snapshot. */
  delete(scope, user, documentId, writerId, snapshotId = null) {
    const k = this.key(scope, user, documentId, writerId);
    const d = DraftStore._parse(this.storage.getItem(k));
    if (!d || (snapshotId !== null && d.snapshotId !== snapshotId)) return false;
    this.storage.removeItem(k);
    return true;
  }

  /** Record that the slot's snapshot is being sent as saveId (before it is sent). */
  markSending(scope, user, documentId, writerId, snapshotId, saveId) {
    const d = this.get(scope, user, documentId, writerId);
    if (!d || d.snapshotId !== snapshotId) return false;
    this.put({ ...d, saveId });
    return true;
  }

  /** An earlier snapshot was saved as baseVersion: the newer one in the slot builds on it. */
  rebase(scope, user, documentId, writerId, baseVersion, exceptSnapshot) {
    const d = this.get(scope, user, documentId, writerId);
    if (!d || d.snapshotId === exceptSnapshot || d.baseVersion >= baseVersion) return false;
    this.put({ ...d, baseVersion });
    return true;
  }

  /**
   * Adopt a sibling's draft into writerId's slot and empty the sibling's. If writing the new
   * slot fails (storage full), the sibling's draft is put back as it was and the error thrown.
   */
  transfer(draft, writerId, snapshotId) {
    const theirs = this.key(draft.scope, draft.user, draft.documentId, draft.writerId);
    const text = this.storage.getItem(theirs);
    const current = DraftStore._parse(text);
    if (!current || current.snapshotId !== draft.snapshotId) {
      throw new DraftChanged(`writer ${draft.writerId}'s draft of document ${draft.documentId} ` +
                             "changed or was removed; list the drafts again");
    }
    const mine = { ...draft, writerId, snapshotId, updatedAt: Date.now() };
    this.storage.removeItem(theirs);          // first: the space it frees is what mine needs
    try {
      this.put(mine);
    } catch (err) {
      this.storage.setItem(theirs, text);     // fits: it was there a moment ago
      throw err;
    }
    return DraftStore._parse(JSON.stringify({ ...mine, content: undefined }));
  }
}

// -------------------------------------------------------------------------------------------
// the session
// -------------------------------------------------------------------------------------------
export class DocumentSession extends EventTarget {
  /**
   * Load a document and start its session.
   * @param {number|string} documentId  a positive integer (or its decimal text: one key)
   * @param {object} o  user (required: part of the draft key; the server decides who saves),
   *   baseUrl, headers, writerId (default: new per session; one another live tab holds is
   *   not shared, see requestedWriterId), storage (localStorage),
   *   scope (default: the API's URL), debounceMs 300, maxWaitMs 5000, retryBaseMs 200,
   *   retryCapMs 10000, requestTimeoutMs 10000, restoreOwnDraft true, flushOnHide true,
   *   onState(snapshot), fetch.
   * @throws DocumentDeleted, HttpError (404 …), NetworkError
   */
  static async open(documentId, o = {}) {
    if (!o.user) throw new TypeError("user is required (it keys the drafts)");
    documentId = documentIdOf(documentId);
    const client = new DocumentsClient(o.baseUrl || "", { headers: o.headers || {},
      timeoutMs: o.requestTimeoutMs ?? 10000, fetch: o.fetch });
    const doc = await client.get(documentId);
    if (doc.deleted) throw new DocumentDeleted(`document ${documentId} was deleted (version ${doc.version})`);
    const s = new DocumentSession(documentId, doc, client, o);
    await s._claimWriter();
    try {
      await s._loadDrafts(doc, o);
    } catch (err) {
      s._releaseWriter();
      throw err;
    }
    s._listen(o.flushOnHide ?? true);
    s._setState();
    s._kick();
    return s;
  }

  /**
   * Hold this writer id (a Web Lock named after the draft slot) while the session lives. A
   * writer id another live tab holds (an app that keeps it in sessionStorage, and the tab
   * was duplicated) is not shared: this session takes a fresh one, so that two tabs never
   * write one draft slot, and the other tab's draft is a sibling (offered, not restored).
   */
  async _claimWriter() {
    let release = await claimLock(`pgfence:writer:${this.draftKey}`);
    if (release === null) {
      this.requestedWriterId = this.writerId;
      this.writerId = `tab:${newId().slice(0, 12)}`;
      release = (await claimLock(`pgfence:writer:${this.draftKey}`)) || (() => {});
    }
    this._releaseWriter = release;
  }

  /** Sort the drafts of (user, document) at open: own one restored, others offered. */
  async _loadDrafts(doc, o) {
    const siblings = [];
    let own = null;
    for (const d of this._drafts.list(this.scope, this.user, this.documentId)) {
      if (sameContent(d.content, doc.content)) {
        // Nothing unsaved in it (its save went through, e.g. from a closing tab): no work lost.
        this._drafts.delete(d.scope, d.user, d.documentId, d.writerId, d.snapshotId);
      } else if (d.writerId === this.writerId) own = d;
      else siblings.push(d);
    }
    if (own && (o.restoreOwnDraft ?? true)) await this._restore(own);
    else if (own) siblings.unshift(own);
    this.siblingDrafts = siblings;
  }

  constructor(documentId, doc, client, o) {
    super();
    this.documentId = documentId;
    this.kind = doc.kind;
    this.user = o.user;
    this.writerId = o.writerId || `tab:${newId().slice(0, 12)}`;
    this.scope = o.scope || client.baseUrl;
    this.debounceMs = o.debounceMs ?? 300;
    this.maxWaitMs = o.maxWaitMs ?? 5000;
    this.retryBaseMs = o.retryBaseMs ?? 200;
    this.retryCapMs = o.retryCapMs ?? 10000;
    this._client = client;
    this._drafts = new DraftStore(o.storage || globalThis.localStorage);
    this._onStateCb = o.onState || null;
    this._sessionId = newId().slice(0, 12);
    // confirmed server state
    this._baseVersion = doc.version;
    this._base = doc.content;
    // local state
    this._localJson = dumps(doc.content);
    this._snapshotId = "";
    this._generation = 0;
    this._confirmedGeneration = 0;
    this._refusedGeneration = -1;
    this._lastEditAt = 0;
    this._dirtySince = null;
    this._urgentGeneration = -1;
    // save machinery
    this._attempt = null;
    this._failures = 0;
    this._retryAt = null;
    this._lastError = null;
    this._offline = false;
    this._inFlight = false;
    this._conflict = null;
    this._io = new Mutex();
    this._timer = null;
    this._closing = false;
    this._closed = false;
    this._waiters = [];
    // reads
    this._readSeq = 0;
    this._appliedReadSeq = 0;
    /** Read answers dropped by the stale-read guard. */
    this.staleReadsDropped = 0;
    this._state = "clean";
    this._lastKey = "";
    /** Other writers' drafts of this user and document: adopt() or discardDraft(). */
    this.siblingDrafts = [];
    /** This writer's own leftover draft restored at open (with a given writerId), or null. */
    this.restoredDraft = null;
    /** The writerId asked for when another live tab held it (this session took a fresh one). */
    this.requestedWriterId = null;
    this._releaseWriter = () => {};
  }

  // --- what a UI reads ----------------------------------------------------------------------
  get state() { return this._state; }
  /** The last version known to be saved (what the next save is based on). */
  get version() { return this._baseVersion; }
  /** The local copy (a fresh object). */
  get content() { return JSON.parse(this._localJson); }
  /** The content of .version as this session knows it. */
  get confirmed() { return this._base; }
  /** True while some local edit is not confirmed by the server. */
  get pending() { return this._generation !== this._confirmedGeneration; }
  get conflict() { return this._conflict; }
  get lastError() { return this._lastError; }
  get draftKey() { return this._drafts.key(this.scope, this.user, this.documentId, this.writerId); }

  snapshot() {
    const err = this._state === "error" || this._state === "offline";
    return Object.freeze({
      state: this._state, version: this._baseVersion, pending: this.pending,
      error: err ? this._lastError : null,
      retryIn: err && this._retryAt !== null ? Math.max(0, this._retryAt - now()) : null,
      conflict: this._conflict,
    });
  }

  // --- editing ------------------------------------------------------------------------------
  /**
   * Replace the local copy with content (the whole document). The draft is written before this
   * returns (so before anything is sent); the save follows after the debounce.
   * @throws SessionClosed; TypeError (not JSON); a storage error (the edit is not taken)
   */
  edit(content) {
    if (this._closing) throw new SessionClosed(`document ${this.documentId}: session is closed`);
    const text = dumps(content);
    if (text === this._localJson) return;
    const snapshotId = `${this._sessionId}:${this._generation + 1}`;
    this._drafts.put({ scope: this.scope, user: this.user, documentId: this.documentId,
                       writerId: this.writerId, kind: this.kind, baseVersion: this._baseVersion,
                       contentJson: text, snapshotId, updatedAt: Date.now(), saveId: null });
    this._generation += 1;
    this._localJson = text;
    this._snapshotId = snapshotId;
    this._markDirty(false);
  }

  _markDirty(urgent) {
    const t = now();
    this._lastEditAt = t;
    if (this._dirtySince === null) this._dirtySince = t;
    if (urgent) this._urgentGeneration = this._generation;
    this._setState();
    this._kick();
  }

  /**
   * Save now (skipping the debounce); resolve with the confirmed version once every edit made
   * before this call is confirmed. Transient failures are retried until timeoutMs.
   * @throws ConflictPending, SaveRefused, FlushTimeout, SessionClosed
   */
  async flush(timeoutMs = 30000) {
    this._rearmUnauthorized();
    const target = this._generation;
    if (this._urgentGeneration < target) this._urgentGeneration = target;
    this._retryAt = null;
    this._kick();
    const deadline = now() + timeoutMs;
    for (;;) {
      if (this._confirmedGeneration >= target) return this._baseVersion;
      if (this._conflict) throw new ConflictPending(this._conflict);
      if (this._refusedGeneration === this._generation) {
        throw new SaveRefused(`document ${this.documentId}: the server refused the save: ` +
                              `${this._lastError && this._lastError.message}`, { cause: this._lastError });
      }
      if (this._closed) throw new SessionClosed(`document ${this.documentId}: session closed`);
      const left = deadline - now();
      if (left <= 0) throw new FlushTimeout(`document ${this.documentId}: not saved within ${timeoutMs} ms`);
      await this._progress(left);
    }
  }

  /**
   * A save refused 401 was refused for its credentials (a token expired), not its content:
   * an explicit flush sends it again, with whatever headers() gives now.
   */
  _rearmUnauthorized() {
    if (this._refusedGeneration === this._generation && this._lastError instanceof HttpError
        && this._lastError.status === 401) {
      this._refusedGeneration = -1;
    }
  }

  _progress(timeoutMs) {
    return new Promise((resolve) => {
      const t = setTimeout(resolve, timeoutMs);
      this._waiters.push(() => { clearTimeout(t); resolve(); });
    });
  }

  // --- the save loop ------------------------------------------------------------------------
  _nextDelay() {
    if (this._closed || this._conflict) return null;
    const t = now();
    if (this._attempt) return this._retryAt === null ? 0 : Math.max(0, this._retryAt - t);
    if (!this.pending || this._refusedGeneration === this._generation) return null;
    let due;
    if (this._urgentGeneration >= this._generation || this._closing) due = t;
    else {
      due = this._lastEditAt + this.debounceMs;
      if (this._dirtySince !== null) due = Math.min(due, this._dirtySince + this.maxWaitMs);
    }
    if (this._retryAt !== null) due = Math.max(due, this._retryAt);
    return Math.max(0, due - t);
  }

  _kick() {
    if (this._timer !== null) { clearTimeout(this._timer); this._timer = null; }
    if (this._closed || this._io.held) return;   // whoever holds the lock kicks on release
    const delay = this._nextDelay();
    if (delay === null) return;
    this._timer = setTimeout(() => { this._timer = null; this._saveOnce(false); }, delay);
  }

  /** One save attempt, if the lock is free (else the holder kicks when it is done). */
  _saveOnce(keepalive) {
    if (!this._io.tryLock()) return Promise.resolve();
    return this._saveLocked(keepalive).finally(() => { this._io.unlock(); this._kick(); });
  }

  async _saveLocked(keepalive) {
    if (this._conflict || this._closed) return;
    if (!this._attempt) {
      if (!this.pending || this._refusedGeneration === this._generation) return;
      this._attempt = { saveId: newId(), expected: this._baseVersion, contentJson: this._localJson,
                        generation: this._generation, snapshotId: this._snapshotId };
      // Before sending: whoever resumes this draft retries with the same save id.
      this._drafts.markSending(this.scope, this.user, this.documentId, this.writerId,
                               this._snapshotId, this._attempt.saveId);
    }
    const att = this._attempt;
    this._inFlight = true;
    this._setState();
    let res;
    try {
      res = await this._client.save(this.documentId, att.expected, att.contentJson, att.saveId,
                                    { keepalive: keepalive && att.contentJson.length < KEEPALIVE_MAX });
    } catch (err) {
      this._inFlight = false;
      this._lastError = err;
      if (err instanceof NetworkError || (err instanceof HttpError && err.transient)) {
        // The outcome is unknown: keep the attempt and send it again, unchanged.
        this._offline = err instanceof NetworkError;
        this._failures += 1;
        const delay = Math.min(this.retryCapMs, this.retryBaseMs * 2 ** (this._failures - 1));
        this._retryAt = now() + delay * (1 - Math.random() / 2);
      } else {
        // Refused: nothing was written. Wait for a new edit.
        this._attempt = null;
        this._offline = false;
        this._refusedGeneration = att.generation;
        this._retryAt = null;
      }
      this._setState();
      this._emit("error", { error: err, retrying: this._attempt !== null });
      return;
    }
    this._inFlight = false;
    this._attempt = null;
    this._failures = 0;
    this._retryAt = null;
    this._lastError = null;
    this._offline = false;
    if (res.outcome === "saved") {
      this._onSaved(att, res);
      this._setState();
      this._emit("saved", { version: res.version, replayed: res.replayed });
    } else {
      this._conflict = Object.freeze({
        baseVersion: att.expected, base: this._base, local: JSON.parse(att.contentJson),
        storedVersion: res.version, stored: res.content, storedBy: res.savedBy,
        deleted: res.deleted,
      });
      this._setState();
      this._emit("conflict", this._conflict);
    }
  }

  _onSaved(att, res) {
    this._baseVersion = res.version;
    this._base = JSON.parse(att.contentJson);
    this._confirmedGeneration = att.generation;
    if (this._generation === att.generation) {
      this._drafts.delete(this.scope, this.user, this.documentId, this.writerId, att.snapshotId);
      this._dirtySince = null;
    } else {
      // Newer edits are pending: their draft is now based on the version just saved.
      this._drafts.rebase(this.scope, this.user, this.documentId, this.writerId, res.version,
                          att.snapshotId);
      this._dirtySince = this._lastEditAt;
    }
  }

  async _withIo(fn) {
    if (this._timer !== null) { clearTimeout(this._timer); this._timer = null; }
    await this._io.lock();
    try { return await fn(); } finally { this._io.unlock(); this._kick(); }
  }

  // --- conflict resolution ------------------------------------------------------------------
  /**
   * Resolve the conflict and save the result against the stored version. Without resolve: the
   * kind's merge on the server; conflicts left → MergeConflict, nothing changes. With
   * resolve({conflict, local, merged}) → the content to save (may return a promise).
   * @throws SessionBusy (no conflict), DocumentDeleted, MergeConflict, StaleRead, HttpError,
   *   NetworkError (nothing changed)
   */
  async rebase(resolve = null, { maxRounds = 5 } = {}) {
    return this._withIo(async () => {
      const conflict = this._conflict;
      if (!conflict) throw new SessionBusy(`document ${this.documentId}: no conflict to rebase`);
      if (conflict.deleted) {
        throw new DocumentDeleted(`document ${this.documentId} was deleted (version ` +
                                  `${conflict.storedVersion}); its local copy is kept`);
      }
      let merged, content, done = false;
      for (let round = 0; round < maxRounds && !done; round++) {
        const generation = this._generation;
        const local = JSON.parse(this._localJson);
        merged = await this._client.merge(this.documentId, conflict.base, local, conflict.stored);
        if (resolve === null) {
          if (merged.conflicts.length) throw new MergeConflict(merged);
          content = merged.content;
        } else {
          content = await resolve({ conflict, local, merged });
        }
        done = generation === this._generation;
      }
      if (!done) throw new StaleRead(`document ${this.documentId}: local edits kept arriving while rebasing`);
      const text = dumps(content);
      const snapshotId = `${this._sessionId}:${this._generation + 1}`;
      this._drafts.put({ scope: this.scope, user: this.user, documentId: this.documentId,
                         writerId: this.writerId, kind: this.kind,
                         baseVersion: conflict.storedVersion, contentJson: text, snapshotId,
                         updatedAt: Date.now(), saveId: null });
      this._generation += 1;
      this._snapshotId = snapshotId;
      this._localJson = text;
      this._baseVersion = conflict.storedVersion;
      this._base = conflict.stored;
      this._conflict = null;
      this._refusedGeneration = -1;
      this._markDirty(true);
      return merged;
    });
  }

  /**
   * Throw away the local copy (and this writer's draft) for the stored version. Fetches first;
   * replaces local state only if the fetch worked and no edit happened meanwhile (→ true).
   * @throws DocumentDeleted, NetworkError, HttpError (nothing changed)
   */
  async discardAndReload() {
    return this._withIo(async () => {
      const [seq, generation] = this._beginRead();
      const doc = await this._client.get(this.documentId);
      if (!this._acceptRead(seq, generation)) return false;
      if (doc.deleted) {
        throw new DocumentDeleted(`document ${this.documentId} was deleted (version ` +
                                  `${doc.version}); the local copy is kept`);
      }
      this._drafts.delete(this.scope, this.user, this.documentId, this.writerId);
      this._applyDocument(doc);
      return true;
    });
  }

  /** Fetch the stored version and take it if nothing is unsaved here (→ true if replaced). */
  async refresh() {
    const [seq, generation] = this._beginRead();
    const doc = await this._client.get(this.documentId);
    if (!this._acceptRead(seq, generation)) return false;
    if (this.pending || this._inFlight || this._attempt || this._conflict || doc.deleted
        || doc.version <= this._baseVersion) return false;
    this._applyDocument(doc);
    return true;
  }

  _beginRead() {
    this._readSeq += 1;
    return [this._readSeq, this._generation];
  }

  /** The stale-read guard: drop an answer older than an applied one, or begun before an edit. */
  _acceptRead(seq, generation) {
    if (seq <= this._appliedReadSeq || generation !== this._generation) {
      this.staleReadsDropped += 1;
      this._emit("staleread", { seq, applied: this._appliedReadSeq });
      return false;
    }
    this._appliedReadSeq = seq;
    return true;
  }

  _applyDocument(doc) {
    this._baseVersion = doc.version;
    this._base = doc.content;
    this._generation += 1;
    this._confirmedGeneration = this._generation;
    this._localJson = dumps(doc.content);
    this._snapshotId = "";
    this._attempt = null;
    this._conflict = null;
    this._dirtySince = null;
    this._retryAt = null;
    this._failures = 0;
    this._lastError = null;
    this._offline = false;
    this._setState();
  }

  // --- other writers' drafts ----------------------------------------------------------------
  async _restore(own) {
    const base = await this._fetchBase(own.baseVersion);
    this.restoredDraft = own;
    this._baseVersion = own.baseVersion;
    this._base = base;
    this._generation += 1;
    this._localJson = own.contentJson;
    this._snapshotId = own.snapshotId;
    this._resumeAttempt(own);
    this._markDirty(true);
  }

  _resumeAttempt(d) {
    if (d.saveId) {
      this._attempt = { saveId: d.saveId, expected: d.baseVersion, contentJson: d.contentJson,
                        generation: this._generation, snapshotId: this._snapshotId };
    }
  }

  async _fetchBase(version) {
    if (version === this._baseVersion) return this._base;
    return (await this._client.revision(this.documentId, version)).content;
  }

  /**
   * Take over a sibling's draft: its content becomes the local copy, based on the version it
   * was edited from, and goes through the server's compare-and-swap (a stale draft becomes a
   * conflict to rebase, never an overwrite).
   * @throws SessionBusy, TypeError (not a sibling draft), DraftChanged
   */
  async adopt(draft) {
    if (!this.siblingDrafts.includes(draft)) throw new TypeError("not one of this session's sibling drafts");
    return this._withIo(async () => {
      if (this.pending || this._conflict || this._attempt) {
        throw new SessionBusy(`document ${this.documentId}: save or discard this session's own ` +
                              "edits before adopting a draft");
      }
      const base = await this._fetchBase(draft.baseVersion);
      const snapshotId = `${this._sessionId}:${this._generation + 1}`;
      const mine = this._drafts.transfer(draft, this.writerId, snapshotId);
      this.siblingDrafts = this.siblingDrafts.filter((d) => d !== draft);
      this._generation += 1;
      this._snapshotId = snapshotId;
      this._localJson = mine.contentJson;
      this._baseVersion = draft.baseVersion;
      this._base = base;
      this._resumeAttempt(mine);
      this._markDirty(true);
      this._emit("drafts", { siblingDrafts: this.siblingDrafts });
    });
  }

  /** Delete a sibling's draft (the person chose to drop it); false if it changed meanwhile. */
  discardDraft(draft) {
    if (!this.siblingDrafts.includes(draft)) throw new TypeError("not one of this session's sibling drafts");
    this.siblingDrafts = this.siblingDrafts.filter((d) => d !== draft);
    const gone = this._drafts.delete(draft.scope, draft.user, draft.documentId, draft.writerId,
                                     draft.snapshotId);
    this._emit("drafts", { siblingDrafts: this.siblingDrafts });
    return gone;
  }

  // --- page lifecycle and closing -----------------------------------------------------------
  _listen(flushOnHide) {
    this._onOnline = () => { this._retryAt = null; this._kick(); };
    this._onHide = (ev) => {
      if (ev.type === "visibilitychange" && document.visibilityState !== "hidden") return;
      this.flushNow();
    };
    globalThis.addEventListener("online", this._onOnline);
    if (flushOnHide) {
      globalThis.addEventListener("pagehide", this._onHide);
      document.addEventListener("visibilitychange", this._onHide);
    }
  }

  /**
   * Send the pending snapshot now, with fetch keepalive so that it survives the page going
   * away (called on pagehide / visibilitychange). The request starts before this returns when
   * nothing else holds the session; either way the draft is already in localStorage.
   */
  flushNow() {
    if (this._closed || this._conflict) return;
    this._rearmUnauthorized();
    this._urgentGeneration = this._generation;
    this._retryAt = null;
    if (this._timer !== null) { clearTimeout(this._timer); this._timer = null; }
    this._saveOnce(true);
  }

  /**
   * Flush, then close. If the flush does not finish in timeoutMs the draft stays in
   * localStorage for the next session. Resolves true if everything was saved.
   */
  async close(timeoutMs = 10000) {
    if (this._closed) return !this.pending;
    this._closing = true;
    let flushed = false;
    try {
      await this.flush(timeoutMs);
      flushed = true;
    } catch (err) {
      if (!(err instanceof SessionError)) throw err;
    } finally {
      this._closed = true;
      this._releaseWriter();
      if (this._timer !== null) clearTimeout(this._timer);
      globalThis.removeEventListener("online", this._onOnline);
      globalThis.removeEventListener("pagehide", this._onHide);
      document.removeEventListener("visibilitychange", this._onHide);
      this._setState();
    }
    return flushed;
  }

  // --- state --------------------------------------------------------------------------------
  _computeState() {
    if (this._closed) return "closed";
    if (this._conflict) return "conflict";
    if (this._inFlight) return "saving";
    if (this._lastError && (this._attempt || this._refusedGeneration === this._generation)) {
      return this._offline ? "offline" : "error";
    }
    return this.pending ? "dirty" : "clean";
  }

  _setState() {
    this._state = this._computeState();
    const waiters = this._waiters;
    this._waiters = [];
    for (const w of waiters) w();
    const snap = this.snapshot();
    const key = `${snap.state}|${snap.version}|${snap.pending}|${snap.conflict ? snap.conflict.storedVersion : ""}`;
    if (key === this._lastKey) return;
    this._lastKey = key;
    this._emit("state", snap);
    if (this._onStateCb) {
      try { this._onStateCb(snap); } catch (err) { console.error("pgfence: onState failed", err); }
    }
  }

  _emit(type, detail) { this.dispatchEvent(new CustomEvent(type, { detail })); }
}
