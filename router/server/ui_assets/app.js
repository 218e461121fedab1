// kvrouter's /admin/ui: reads the /admin JSON API and draws it. No data is in this file or
// the page: every number comes from a fetch that carries the admin token the operator typed
// (kept in sessionStorage, sent as "Authorization: Bearer"), so the router's doors guard all
// of it. Strings go into the page as text nodes only, never parsed as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "kvrouter.admin_token";
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let busy = false;
  let models = [];

  // -- helpers ----------------------------------------------------------------------------

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) e.setAttribute(k, String(v));
    }
    for (const kid of kids) {
      if (kid === null || kid === undefined) continue;
      e.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return e;
  }

  // a table: head is a list of column names, rows a list of {attrs, cells: [[field, value]]}
  function table(head, rows, empty) {
    if (!rows.length) return el("p", { class: "empty" }, empty || "none");
    const thead = el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h))));
    const tbody = el("tbody", {});
    for (const row of rows) {
      const tr = el("tr", row.attrs || {});
      for (const [field, value, cls] of row.cells) {
        tr.append(el("td", { "data-f": field, class: cls || null }, value));
      }
      tbody.append(tr);
    }
    return el("table", {}, thead, tbody);
  }

  const num = (v) => (v === null || v === undefined ? "–" : String(v));
  const perRank = (d) =>
    d ? Object.entries(d).map(([r, v]) => (r === "-1" ? "" : "dp" + r + " ") + v).join(", ") : "–";
  const when = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  async function api(path, body) {
    const headers = { accept: "application/json" };
    const t = token();
    if (t) headers.authorization = "Bearer " + t;
    const init = { headers, cache: "no-store", credentials: "omit" };
    if (body !== undefined) {
      init.method = "POST";
      headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    let data = null;
    try {
      data = await r.json();
    } catch (e) {
      data = null;
    }
    if (!r.ok) {
      const msg = data && data.error ? data.error.message : r.statusText;
      const err = new Error(r.status + ": " + msg);
      err.status = r.status;
      throw err;
    }
    return data;
  }

  function status(text, bad) {
    const s = $("status");
    s.textContent = text;
    s.className = bad ? "status bad" : "status";
  }

  // -- views ------------------------------------------------------------------------------

  function healthOf(rep) {
    if (rep.drained) return "drained";
    const st = rep.health ? rep.health.state : "unknown";
    return st === "healthy" ? "up" : st;
  }

  function drawReplicas(data, index) {
    const sizes = {};
    for (const pool of index.pools) {
      for (const [name, tiers] of Object.entries(pool.replicas)) {
        const parts = [];
        for (const [tier, groups] of Object.entries(tiers)) {
          const n = Object.values(groups).reduce((a, b) => a + b, 0);
          parts.push(tier + " " + n);
        }
        sizes[pool.pool + "\u0000" + name] = parts.join(", ");
      }
    }
    const rows = data.replicas.map((rep) => {
      const health = healthOf(rep);
      const trust = Object.entries(rep.trust || {});
      const trustCell = el("span", {});
      for (const [rank, t] of trust) {
        trustCell.append(el("span", { class: "chip " + t, "data-rank": rank }, rank + " " + t));
      }
      if (!trust.length) trustCell.append("–");
      const entries = rep.dp_ranks
        .map((r) => [r, sizes[rep.pool + "\u0000" + rep.name + "/dp" + r]])
        .filter(([, x]) => x)
        .map(([r, x]) => (rep.dp_ranks.length > 1 ? "dp" + r + " " : "") + x);
      return {
        attrs: { "data-row": "replica", "data-name": rep.name },
        cells: [
          ["pool", rep.pool],
          ["name", rep.name],
          ["url", rep.url],
          ["source", rep.source || ""],
          ["health", health, "h-" + health],
          ["trust", trustCell],
          ["in_flight", num(rep.in_flight)],
          ["pending", num(rep.pending_prefill_tokens)],
          ["running", perRank(rep.running)],
          ["waiting", perRank(rep.waiting)],
          ["kv_usage", perRank(rep.kv_usage)],
          ["index", entries.length ? entries.join("; ") : "0"],
          ["last_error", rep.last_error || (rep.health && rep.health.last_error) || ""],
        ],
      };
    });
    $("replicas").replaceChildren(
      table(
        ["pool", "replica", "url", "source", "health", "trust", "in flight", "pending prefill",
         "running", "waiting", "kv usage", "index blocks", "last error"],
        rows, "no replicas")
    );
  }

  function drawIndex(index) {
    const rows = index.pools.map((p) => ({
      attrs: { "data-row": "pool", "data-name": p.pool },
      cells: [
        ["pool", p.pool],
        ["entries", num(p.entries)],
        ["bytes", num(p.bytes)],
        ["max_bytes", num(p.max_bytes)],
        ["reclaimed", num(p.reclaimed)],
        ["groups", p.groups.map((g, i) => i + ": " + g.kind + " block " + g.block_size +
          (g.sliding_window ? " window " + g.sliding_window : "")).join(", ")],
      ],
    }));
    $("index").replaceChildren(
      table(["pool", "entries", "bytes", "max bytes", "reclaimed", "groups"], rows, "no pools")
    );
    const names = index.pools.map((p) => p.pool);
    if (names.join("\u0000") !== models.join("\u0000")) {
      models = names;
      const sel = $("ex-model");
      const keep = sel.value || sel.dataset.want || "";
      sel.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
      if (names.includes(keep)) sel.value = keep;
    }
  }

  function drawDecisions(data) {
    const rows = data.decisions.slice().reverse().map((d) => {
      const label = d.replica + (d.hits.filter((h) => h.replica === d.replica).length > 1
        ? "/dp" + d.dp_rank : "");
      const off = d.cached_tokens !== null && d.predicted_hit !== null &&
        d.cached_tokens !== d.predicted_hit;
      const groups = d.longest_group_hit === null ? "–"
        : "longest " + d.longest_group_hit +
          (d.limiting_group ? " · cut by " + d.limiting_group : "");
      return {
        attrs: { "data-row": "decision", "data-request-id": d.request_id || "" },
        cells: [
          ["time", when(d.time)],
          ["request_id", (d.request_id || "").slice(0, 12)],
          ["pool", d.pool],
          ["replica", label],
          ["reason", d.reason],
          ["num_tokens", num(d.num_tokens)],
          ["predicted_hit", num(d.predicted_hit)],
          ["expected_hit", num(d.expected_hit)],
          ["cached_tokens", num(d.cached_tokens), off ? "bad" : null],
          ["trust", num(d.trust)],
          ["groups", groups],
          ["hits", d.hits.map((h) => h.replica + ":" + h.hit_tokens).join(" ")],
          ["status", num(d.status), d.status >= 400 ? "bad" : null],
          ["router_ms", num(d.router_ms)],
          ["total_ms", num(d.total_ms)],
        ],
      };
    });
    $("decisions").replaceChildren(
      table(["time", "request", "pool", "replica", "why", "tokens", "predicted", "expected",
             "cached", "trust", "groups", "hit per replica", "status", "router ms", "total ms"],
        rows, "no request routed yet")
    );
  }

  function groupText(g) {
    return g ? Object.entries(g).map(([k, v]) => k + " " + v).join(", ") : "–";
  }

  function drawMismatches(data) {
    const rows = data.mismatches.slice().reverse().map((m) => ({
      attrs: { "data-row": "mismatch" },
      cells: [
        ["time", when(m.time)],
        ["request_id", (m.request_id || "").slice(0, 12)],
        ["replica", m.replica],
        ["num_tokens", num(m.num_tokens)],
        ["predicted", num(m.predicted)],
        ["cached_tokens", num(m.cached_tokens)],
        ["error", num(m.error), "bad"],
        ["groups", groupText(m.prediction && m.prediction.spec_group_hits)],
        ["limiting_group", (m.prediction && m.prediction.limiting_group) || "–"],
      ],
    }));
    $("mismatches").replaceChildren(
      table(["time", "request", "replica", "tokens", "predicted", "cached", "error",
             "per-group hits", "limiting group"], rows, "none: every reported hit was predicted")
    );
  }

  function drawExplain(ex) {
    const chosen = ex.chosen.replica + (ex.replicas.filter((r) => r.replica === ex.chosen.replica)
      .length > 1 ? "/dp" + ex.chosen.dp_rank : "");
    const summary = el("p", { class: "summary" },
      "chosen ", el("b", { "data-f": "chosen" }, chosen),
      " · policy " + ex.policy + " · " + ex.num_tokens + " tokens" +
      (ex.tokenized ? "" : " (not tokenized: " + (ex.untokenized_reason || "?") + ")") +
      " · decided in " + (ex.decision_seconds * 1e6).toFixed(0) + " µs" +
      (ex.panic ? " · PANIC (no healthy replica)" : ""));
    const groupNames = [];
    for (const r of ex.replicas) {
      for (const g of Object.keys(r.spec_group_hits || {})) {
        if (!groupNames.includes(g)) groupNames.push(g);
      }
    }
    const rows = ex.replicas.map((r) => ({
      attrs: { "data-row": "explain", "data-name": r.replica, "data-rank": r.dp_rank,
               class: r.replica === ex.chosen.replica && r.dp_rank === ex.chosen.dp_rank
                 ? "chosen" : null },
      cells: [
        ["replica", r.replica + "/dp" + r.dp_rank],
        ["trust", num(r.trust)],
        ["hit_tokens", num(r.hit_tokens)],
        ["expected_hit_tokens", num(r.expected_hit_tokens)],
        ...groupNames.map((g) => ["group:" + g, num((r.spec_group_hits || {})[g])]),
        ["limiting_group", num(r.limiting_group)],
        ["in_flight", r.load ? num(r.load.in_flight) : "–"],
        ["cost", r.score ? Number(r.score.cost).toFixed(1) : "–"],
        ["health", r.health ? r.health.state : "–"],
      ],
    }));
    const parts = [summary, table(["replica", "trust", "hit", "expected hit", ...groupNames,
      "limiting group", "in flight", "cost", "health"], rows)];
    if (ex.excluded.length) {
      parts.push(el("p", {}, "not candidates: " +
        ex.excluded.map((x) => x.replica + " (" + x.reason + ")").join(", ")));
    }
    $("explain").replaceChildren(...parts);
  }

  async function drawApi() {
    try {
      const schema = await api("../../openapi.json");
      const rows = [];
      for (const [path, ops] of Object.entries(schema.paths || {})) {
        for (const [method, op] of Object.entries(ops)) {
          rows.push({ cells: [["method", method.toUpperCase()], ["path", path],
                              ["summary", op.summary || ""]] });
        }
      }
      $("api").replaceChildren(table(["method", "path", "summary"], rows));
    } catch (e) {
      $("api").replaceChildren(el("p", { class: "bad" }, "cannot read /openapi.json: " + e.message));
    }
  }

  // -- refresh loop -----------------------------------------------------------------------

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      const [reps, index, decisions, mismatches] = await Promise.all([
        api("../replicas"), api("../index"), api("../decisions"), api("../mismatches"),
      ]);
      drawReplicas(reps, index);
      drawIndex(index);
      drawDecisions(decisions);
      drawMismatches(mismatches);
      status("updated " + new Date().toLocaleTimeString());
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        status("the admin API refused: " + e.message + " (type the admin token)", true);
      } else {
        status("refresh failed: " + e.message, true);
      }
    } finally {
      busy = false;
    }
  }

  function schedule() {
    if (timer !== null) clearInterval(timer);
    timer = null;
    const every = Number($("interval").value);
    if (every > 0) timer = setInterval(refresh, every);
  }

  async function explain(ev) {
    if (ev) ev.preventDefault();
    const kind = document.querySelector("input[name=ex-kind]:checked").value;
    const text = $("ex-input").value;
    const body = { model: $("ex-model").value || $("ex-model").dataset.want || null };
    if (kind === "token_ids") {
      const ids = text.split(/[\s,]+/).filter((x) => x !== "").map(Number);
      if (ids.some((x) => !Number.isInteger(x) || x < 0)) {
        $("explain").replaceChildren(el("p", { class: "bad" }, "token ids must be integers >= 0"));
        return;
      }
      body.token_ids = ids;
    } else {
      body.prompt = text;
    }
    $("explain").replaceChildren(el("p", {}, "asking…"));
    try {
      drawExplain(await api("../route/explain", body));
    } catch (e) {
      $("explain").replaceChildren(el("p", { class: "bad", "data-f": "error" }, e.message));
    }
  }

  // The fragment (never sent to the server): #token=…&model=…&prompt=…|token_ids=…&explain=1
  function fromFragment() {
    const p = new URLSearchParams(location.hash.replace(/^#/, ""));
    if (p.has("token")) {
      sessionStorage.setItem(TOKEN_KEY, p.get("token"));
      p.delete("token");
      const rest = p.toString();
      history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
    }
    if (p.has("model")) $("ex-model").dataset.want = p.get("model");
    if (p.has("token_ids")) {
      document.querySelector("input[name=ex-kind][value=token_ids]").checked = true;
      $("ex-input").value = p.get("token_ids");
    } else if (p.has("prompt")) {
      $("ex-input").value = p.get("prompt");
    }
    if (p.has("refresh")) $("interval").value = p.get("refresh");
    return p.get("explain") === "1";
  }

  async function start() {
    const run = fromFragment();
    $("token").value = token();
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      refresh();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      $("token").value = "";
      refresh();
    });
    $("interval").addEventListener("change", schedule);
    $("explain-form").addEventListener("submit", explain);
    await refresh();
    schedule();
    drawApi();
    if (run) await explain();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
