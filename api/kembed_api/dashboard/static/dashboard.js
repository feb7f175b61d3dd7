// The kembed dashboard: each page is a server-rendered shell; this script fills it from the JSON API (the same
// endpoints clients use, with the session cookie) and keeps it live by polling every 2 s. No framework, no build.
"use strict";

(() => {
  const body = document.body;
  const HOME = body.dataset.home;
  const PAGE = body.dataset.page;
  const CAN_SUBMIT = body.dataset.canSubmit === "true";
  const CSRF = document.querySelector('meta[name="csrf-token"]').content;
  const CSRF_HEADER = document.querySelector('meta[name="csrf-header"]').content;
  const POLL_MS = 2000;
  // The job lifecycle (kembed_contract.lifecycle), as the page was served: each state's tone, and which end a job.
  const { terminal, ...TONE } = JSON.parse(body.dataset.states);
  const TERMINAL = new Set(terminal);
  // The quota's dimensions (kembed_contract.quota.QuotaSpec), as the page was served: each one's field, amount name,
  // label, unit, how it is kept ("count", "cores" or "bytes"), the usage measured against it and whether running
  // jobs hold it (then its usage is in `used`, else a count the tenant keeps). Every bar, column and quota form
  // field below is drawn from this list.
  const QUOTA = JSON.parse(body.dataset.quota);
  const HELD = QUOTA.filter((d) => d.held);
  const $ = (selector) => document.querySelector(selector);

  // ------------------------------------------------------------------------------------------ the API
  // Every API error has one shape: {detail: "one line per problem", errors: [{loc, msg, type}, ...]}.
  class ApiError extends Error {
    constructor(status, body) {
      super(body && typeof body.detail === "string" ? body.detail : `HTTP ${status}`);
      this.status = status;
      this.errors = (body && Array.isArray(body.errors)) ? body.errors : [];
    }
  }

  async function api(path, { method = "GET", json, text = false } = {}) {
    const headers = { Accept: text ? "text/plain" : "application/json" };
    if (method !== "GET") headers[CSRF_HEADER] = CSRF;
    if (json !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, credentials: "same-origin", cache: "no-cache",
      body: json === undefined ? undefined : JSON.stringify(json),
    });
    if (response.status === 401) {
      location.assign(`${HOME}/sign-in`);
      throw new ApiError(401, { detail: "signed out" });
    }
    const type = response.headers.get("content-type") || "";
    const data = response.status === 204 ? null : type.includes("json") ? await response.json() : await response.text();
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  // Run `work` now and again `ms` after each run ends, until it returns false.
  function poll(work, ms = POLL_MS) {
    const status = $("#live-status");
    const run = async () => {
      let again = true;
      try {
        again = (await work()) !== false;
        if (status.dataset.failing) {
          delete status.dataset.failing;
          status.textContent = "";
        }
      } catch (error) {
        status.dataset.failing = "1";
        status.textContent = `Could not refresh: ${error.message}`;
      }
      if (again) setTimeout(run, ms);
    };
    run();
  }

  // ----------------------------------------------------------------------------------------- elements
  function h(tag, attrs = {}, ...children) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  const SVG = "http://www.w3.org/2000/svg";
  function s(tag, attrs = {}, ...children) {
    const el = document.createElementNS(SVG, tag);
    setAttrs(el, attrs);
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function setAttrs(el, attrs) {
    for (const [key, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else if (key === "text") el.textContent = value;
      else el.setAttribute(key, value === true ? "" : String(value));
    }
  }

  function jobLink(id) {
    return h("a", { href: `${HOME}/jobs/${encodeURIComponent(id)}` }, id);
  }

  function stateClass(state) {
    return `state tone-${TONE[state] || "waiting"}`;
  }

  function stateBadge(state) {
    return h("span", { class: stateClass(state) }, state);
  }

  // A table kept in place across refreshes: rows are matched by key and only cells whose content changed are
  // replaced, so focus and selection survive the 2-second updates.
  function syncTable(container, { label, columns, rows, key, empty }) {
    let table = container.querySelector("table");
    let message = container.querySelector("p.empty");
    if (!rows.length) {
      if (table) table.remove();
      if (!message) container.append(h("p", { class: "empty" }, empty));
      return;
    }
    if (message) message.remove();
    if (!table) {
      table = h("table", {},
        h("caption", { class: "visually-hidden" }, label),
        h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.numeric ? "num" : null }, c.title)))),
        h("tbody"));
      container.append(table);
    }
    const tbody = table.tBodies[0];
    const existing = new Map([...tbody.rows].map((tr) => [tr.dataset.key, tr]));
    const wanted = [];
    for (const row of rows) {
      const k = String(key(row));
      let tr = existing.get(k);
      if (!tr) {
        tr = h("tr", { "data-key": k }, columns.map((c) => h(c.header ? "th" : "td", {
          class: [c.class, c.numeric ? "num" : null].filter(Boolean).join(" ") || null,
          scope: c.header ? "row" : null,
        })));
      }
      existing.delete(k);
      columns.forEach((column, i) => {
        const cell = tr.cells[i];
        const content = column.cell(row);
        const signature = content instanceof Node ? content.outerHTML : String(content ?? "");
        if (cell.dataset.signature !== signature) {
          cell.dataset.signature = signature;
          cell.replaceChildren(content instanceof Node ? content : document.createTextNode(signature));
        }
      });
      wanted.push(tr);
    }
    for (const tr of existing.values()) tr.remove();
    wanted.forEach((tr, i) => {
      if (tbody.rows[i] !== tr) tbody.insertBefore(tr, tbody.rows[i] || null);
    });
  }

  // ------------------------------------------------------------------------------------------- formats
  const number = (value, digits = 0) =>
    value === null || value === undefined ? "—" : Number(value).toLocaleString("en", { maximumFractionDigits: digits });

  function bytes(value) {
    if (value === null || value === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let v = value, i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return `${number(v, v < 10 && i ? 1 : 0)} ${units[i]}`;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 60) return `${seconds} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${seconds % 60} s`;
    const hours = Math.floor(seconds / 3600);
    if (hours < 48) return `${hours} h ${Math.floor((seconds % 3600) / 60)} min`;
    return `${Math.floor(hours / 24)} d ${hours % 24} h`;
  }

  const since = (iso) => (Date.now() - Date.parse(iso)) / 1000;
  const until = (iso) => (Date.parse(iso) - Date.now()) / 1000;

  function when(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    const today = new Date().toDateString() === d.toDateString();
    return today ? d.toLocaleTimeString("en-GB") : d.toLocaleString("en-GB", { dateStyle: "short", timeStyle: "short" });
  }

  function timeEl(iso, text) {
    return iso ? h("time", { datetime: iso, title: new Date(iso).toISOString() }, text ?? when(iso)) : "—";
  }

  function inWords(iso) {
    if (!iso) return "unknown yet";
    const left = until(iso);
    return left <= 1 ? "now" : `in ${duration(left)}`;
  }

  // ------------------------------------------------------------------------------------------ the team page
  function level(used, limit) {
    if (limit === null || limit === undefined) return "none";
    const ratio = limit === 0 ? (used > 0 ? Infinity : 0) : used / limit;
    if (ratio > 1) return "over";
    if (ratio >= 0.9) return "full";
    if (ratio >= 0.7) return "warn";
    return "ok";
  }

  // An amount of a dimension, as the page shows it: bytes in their unit, other amounts as numbers.
  function amount(d, value) {
    return d.kind === "bytes" ? bytes(value) : number(value, 1);
  }

  const LEVEL_WORDS = { ok: "", warn: "nearly full", full: "full", over: "above quota (borrowed)", none: "no limit" };

  function renderBars(overview) {
    const { usage } = overview;
    // A bar for each dimension something is measured against (not, say, a time limit per job).
    const dims = QUOTA.filter((d) => d.used).map((d) => ({
      key: d.field, label: d.label, fmt: (v) => amount(d, v),
      used: d.held ? usage.used[d.used] : usage[d.used], limit: overview.quota_amounts[d.amount],
    })).filter((d) => d.used !== undefined);
    const container = $("#bars");
    for (const d of dims) {
      let row = container.querySelector(`[data-dim="${d.key}"]`);
      if (!row) {
        row = h("div", { class: "bar-row", "data-dim": d.key },
          h("span", { class: "bar-label", id: `bar-label-${d.key}` }, d.label),
          h("div", { class: "track", role: "meter", "aria-labelledby": `bar-label-${d.key}`, "aria-valuemin": 0 },
            h("div", { class: "fill" })),
          h("span", { class: "bar-value" }));
        container.append(row);
      }
      const lvl = level(d.used, d.limit);
      const limited = lvl !== "none";
      const share = limited ? (d.limit === 0 ? (d.used > 0 ? 1 : 0) : Math.min(1, d.used / d.limit)) : 0;
      const words = `${d.fmt(d.used)} of ${limited ? d.fmt(d.limit) : "unlimited"}`;
      row.dataset.used = d.used;
      row.dataset.limit = limited ? d.limit : "";
      row.dataset.level = lvl;
      const track = row.querySelector(".track");
      track.setAttribute("aria-valuenow", d.used);
      track.setAttribute("aria-valuemax", limited ? Math.max(d.limit, d.used) : d.used);
      track.setAttribute("aria-valuetext", `${words}${LEVEL_WORDS[lvl] ? ", " + LEVEL_WORDS[lvl] : ""}`);
      const fill = row.querySelector(".fill");
      fill.className = `fill ${lvl}`;
      fill.style.width = `${(share * 100).toFixed(1)}%`;
      const over = lvl === "over" ? ` · ${d.fmt(d.used - d.limit)} borrowed` : "";
      row.querySelector(".bar-value").textContent = `${d.fmt(d.used)} / ${limited ? d.fmt(d.limit) : "∞"}${over}`;
    }
  }

  // A cohort member borrows beyond its quota what the others leave idle, and lends its own idle quota.
  function renderSharing(sharing) {
    const line = $("#sharing");
    if (!sharing) { line.hidden = true; return; }
    const amounts = (a) => HELD.filter((d) => a[d.used])
      .map((d) => d.kind === "bytes" ? bytes(a[d.used]) : `${number(a[d.used], 1)} ${d.unit}`).join(", ") || "nothing";
    line.hidden = false;
    line.textContent = `Cohort ${sharing.cohort}: borrowing ${amounts(sharing.borrowed)} · lending ${amounts(sharing.lent)}`;
  }

  function progressCell(job) {
    const p = job.progress;
    return h("span", { class: "progress-cell" },
      h("progress", { max: p.total_steps || 1, value: p.step, "aria-label": `${job.id} progress` }),
      h("span", { class: "step" }, `${number(p.step)} / ${number(p.total_steps)}`));
  }

  function resultText(values) {
    if (!values) return "—";
    const parts = [];
    for (const key of ["auc", "rmse", "loss"]) {
      if (typeof values[key] === "number") parts.push(`${key.toUpperCase()} ${values[key].toFixed(4)}`);
    }
    return parts.join(" · ") || "—";
  }

  function teamPage() {
    poll(async () => {
      const o = await api("/v1/overview");
      renderBars(o);
      renderSharing(o.usage.sharing);
      $("#running-count").textContent = `(${o.running.length})`;
      syncTable($("#running"), {
        label: "Running jobs", key: (j) => j.id, rows: o.running, empty: "No job holds quota now.",
        columns: [
          { title: "Job", header: true, cell: (j) => jobLink(j.id) },
          { title: "State", cell: (j) => stateBadge(j.state) },
          { title: "Step", class: "progress", cell: progressCell },
          { title: "Samples/s", numeric: true, class: "speed", cell: (j) => number(j.metrics.samples_per_sec) },
          { title: "Loss", numeric: true, class: "loss", cell: (j) => number(j.metrics.loss, 4) },
          { title: "Finishes", class: "eta", cell: (j) => j.estimated_end_at ? inWords(j.estimated_end_at) : "—" },
        ],
      });
      const queued = o.usage.queued_jobs;
      $("#queue-count").textContent = `(${queued}${queued > o.queue.length ? `, first ${o.queue.length} shown` : ""})`;
      syncTable($("#queue"), {
        label: "Queue in admission order", key: (j) => j.id, rows: o.queue, empty: "Nothing is waiting.",
        columns: [
          { title: "#", numeric: true, class: "position", cell: (j) => String(j.queue_position) },
          { title: "Job", header: true, cell: (j) => jobLink(j.id) },
          { title: "Priority", numeric: true, cell: (j) => String(j.priority) },
          { title: "Waiting", cell: (j) => duration(since(j.created_at)) },
          { title: "Expected start", class: "start", cell: (j) => j.estimated_start_at ? inWords(j.estimated_start_at) : "unknown yet" },
          { title: "Why it waits", class: "why", cell: (j) => j.message },
        ],
      });
      syncTable($("#finished"), {
        label: "Recently finished jobs", key: (j) => j.id, rows: o.finished, empty: "No job has finished yet.",
        columns: [
          { title: "Job", header: true, cell: (j) => jobLink(j.id) },
          { title: "State", cell: (j) => stateBadge(j.state) },
          { title: "Finished", cell: (j) => timeEl(j.finished_at) },
          { title: "Ran for", cell: (j) => j.started_at && j.finished_at ? duration((Date.parse(j.finished_at) - Date.parse(j.started_at)) / 1000) : "—" },
          { title: "Result", class: "result", cell: (j) => resultText(j.result) },
        ],
      });
      $("#by-state").textContent = Object.entries(o.jobs_by_state).sort()
        .map(([state, n]) => `${number(n)} ${state.toLowerCase()}`).join(" · ") || "no jobs yet";
      const updated = $("#updated");
      updated.textContent = when(o.generated_at);
      updated.setAttribute("datetime", o.generated_at);
    });
  }

  // ------------------------------------------------------------------------------------------- charts
  // A line chart of [{name, points: [[x, y], ...]}] as inline SVG, with axes labelled at their ends.
  const PALETTE = ["#1f5fa8", "#b3261e", "#2e7d32", "#6a3fa0"];

  function lineChart(container, series, { xLabel, title }) {
    const W = 520, H = 220, L = 56, R = 12, T = 12, B = 36;
    const points = series.flatMap((s) => s.points);
    container.replaceChildren();
    if (!points.length) {
      container.append(h("p", { class: "empty" }, "No values reported yet."));
      return;
    }
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) x1 = x0 + 1;
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.05 || 0.5; y1 += Math.abs(y1) * 0.05 || 0.5; }
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const summary = series.map((s) => {
      const last = s.points[s.points.length - 1];
      return last ? `${s.name} ${number(last[1], 4)} at ${xLabel} ${number(last[0])}` : `${s.name}: none`;
    }).join("; ");
    const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${title}: ${summary}`, class: "line-chart" },
      s("title", {}, title),
      s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
      s("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }),
      s("text", { x: L - 6, y: T + 4, "text-anchor": "end", class: "tick" }, number(y1, 3)),
      s("text", { x: L - 6, y: H - B, "text-anchor": "end", class: "tick" }, number(y0, 3)),
      s("text", { x: L, y: H - B + 16, "text-anchor": "start", class: "tick" }, number(x0)),
      s("text", { x: W - R, y: H - B + 16, "text-anchor": "end", class: "tick" }, number(x1)),
      s("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "tick" }, xLabel),
      series.map((serie, i) => s("polyline", {
        points: serie.points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" "),
        fill: "none", stroke: PALETTE[i % PALETTE.length], "stroke-width": 2, class: "series",
        "data-series": serie.name,
      })));
    container.append(svg);
    if (series.length > 1) {
      container.append(h("p", { class: "chart-legend" }, series.map((serie, i) =>
        h("span", {}, h("span", { class: `key key-${i}` }), serie.name))));
    }
  }

  function barChart(container, days, keys, { title }) {
    const W = 720, H = 220, L = 48, R = 8, T = 12, B = 40;
    const max = Math.max(0.001, ...days.flatMap((d) => keys.map((k) => d[k.key])));
    const band = (W - L - R) / days.length;
    const barW = Math.max(1, (band * 0.8) / keys.length);
    container.replaceChildren();
    const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "bar-chart",
      "aria-label": `${title}: ` + keys.map((k) => `${k.name} ${number(days.reduce((a, d) => a + d[k.key], 0), 2)} in all`).join(", ") },
      s("title", {}, title),
      s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
      s("text", { x: L - 6, y: T + 4, "text-anchor": "end", class: "tick" }, number(max, 2)),
      s("text", { x: L - 6, y: H - B, "text-anchor": "end", class: "tick" }, "0"),
      days.map((d, i) => keys.map((k, j) => {
        const height = ((d[k.key] || 0) / max) * (H - T - B);
        return s("rect", { x: L + i * band + band * 0.1 + j * barW, y: H - B - height, width: barW, height,
          fill: PALETTE[j], "data-day": d.day, "data-series": k.key }, s("title", {}, `${d.day}: ${number(d[k.key], 2)} ${k.name}`));
      })),
      days.map((d, i) => (days.length <= 10 || i % Math.ceil(days.length / 10) === 0)
        ? s("text", { x: L + i * band + band / 2, y: H - B + 16, "text-anchor": "middle", class: "tick" }, d.day.slice(5))
        : null));
    container.append(svg, h("p", { class: "chart-legend" }, keys.map((k, j) =>
      h("span", {}, h("span", { class: `key key-${j}` }), k.name))));
  }

  // ---------------------------------------------------------------------------------------- history page
  function historyPage() {
    let days = 7;
    const load = async () => {
      const history = await api(`/v1/usage/history?days=${days}`);
      $("#csv").setAttribute("href", `/v1/usage/history?days=${days}&format=csv`);
      const facts = [
        ["GPU-hours", number(history.gpu_hours, 2)], ["CPU-hours", number(history.cpu_hours, 2)],
        ["Average queue wait", duration(history.avg_queue_wait_s)], ["p90 queue wait", duration(history.p90_queue_wait_s)],
        ["Jobs admitted", number(history.per_day.reduce((a, d) => a + d.jobs_admitted, 0))],
        ["Preemptions", number(history.preemptions)], ["Restarts", number(history.restarts)],
      ];
      $("#summary").replaceChildren(...facts.map(([k, v]) => h("div", { class: "card" }, h("dt", {}, k), h("dd", {}, v))));
      barChart($("#hours-chart"), history.per_day,
        [{ key: "gpu_hours", name: "GPU-hours" }, { key: "cpu_hours", name: "CPU-hours" }],
        { title: `GPU-hours and CPU-hours per day over ${days} days` });
      const states = Object.entries(history.finished).map(([state, n]) => ({ state, n }));
      $("#states").replaceChildren();
      syncTable($("#states"), {
        label: "Jobs by final state", key: (r) => r.state, rows: states, empty: "No job ended in this window.",
        columns: [{ title: "State", header: true, cell: (r) => stateBadge(r.state) }, { title: "Jobs", numeric: true, cell: (r) => String(r.n) }],
      });
      $("#days").replaceChildren();
      syncTable($("#days"), {
        label: "Per day", key: (d) => d.day, rows: [...history.per_day].reverse(), empty: "",
        columns: [
          { title: "Day", header: true, cell: (d) => d.day },
          { title: "GPU-hours", numeric: true, cell: (d) => number(d.gpu_hours, 2) },
          { title: "CPU-hours", numeric: true, cell: (d) => number(d.cpu_hours, 2) },
          { title: "Admitted", numeric: true, cell: (d) => String(d.jobs_admitted) },
          { title: "Avg wait", numeric: true, cell: (d) => duration(d.avg_queue_wait_s) },
          { title: "p90 wait", numeric: true, cell: (d) => duration(d.p90_queue_wait_s) },
          { title: "Preempted", numeric: true, cell: (d) => String(d.preemptions) },
          { title: "Restarts", numeric: true, cell: (d) => String(d.restarts) },
          { title: "Ended", cell: (d) => Object.entries(d.finished).map(([k, v]) => `${v} ${k.toLowerCase()}`).join(", ") || "—" },
        ],
      });
    };
    for (const button of document.querySelectorAll("button.window")) {
      button.addEventListener("click", () => {
        days = Number(button.dataset.days);
        for (const b of document.querySelectorAll("button.window")) b.setAttribute("aria-pressed", String(b === button));
        load().catch(showError);
      });
    }
    poll(load, 30000);
  }

  function showError(error) {
    $("#live-status").textContent = error.message;
  }

  // -------------------------------------------------------------------------------------------- job page
  function jobPage() {
    const id = body.dataset.jobId;
    const path = `/v1/jobs/${encodeURIComponent(id)}`;
    let job = null;
    let checkpointStep;
    const notice = $("#action-result");
    const say = (text) => { notice.hidden = false; notice.textContent = text; };

    const cancel = $("#cancel");
    if (cancel) {
      cancel.addEventListener("click", async () => {
        if (cancel.dataset.confirm !== "1") {
          cancel.dataset.confirm = "1";
          cancel.textContent = "Confirm cancel";
          return;
        }
        cancel.disabled = true;
        try {
          job = await api(`${path}/cancel`, { method: "POST" });
          say(job.state === "CANCELLED" ? "Cancelled." : "Cancel requested: the trainer saves a checkpoint, then stops.");
          renderHead(job);
        } catch (error) {
          say(`Could not cancel: ${error.message}`);
          cancel.disabled = false;
        }
      });
    }
    const again = $("#resubmit");
    if (again) {
      again.addEventListener("click", async () => {
        if (!job) return;
        const spec = structuredClone(job.spec);
        // The old job's default checkpoint folder (served with the page) is its own: the new job gets its own
        // default unless the old one named a folder.
        if (spec.trainer.checkpoint && spec.trainer.checkpoint.uri === body.dataset.defaultCheckpointFolder) {
          spec.trainer.checkpoint.uri = null;
        }
        again.disabled = true;
        try {
          const created = await api("/v1/jobs", { method: "POST", json: spec });
          location.assign(`${HOME}/jobs/${encodeURIComponent(created.id)}`);
        } catch (error) {
          say(`Could not submit: ${error.message}`);
          again.disabled = false;
        }
      });
    }

    function renderHead(j) {
      const state = $("#job-state");
      state.textContent = j.state;
      state.className = stateClass(j.state);
      $("#job-reason").textContent = j.reason;
      $("#job-message").textContent = j.message ? `— ${j.message}` : "";
      if (cancel) cancel.hidden = TERMINAL.has(j.state) || cancel.disabled && cancel.dataset.confirm === "1";
      const m = j.metrics || {};
      const facts = [
        ["Name", j.name], ["Priority", String(j.priority)],
        ["Progress", `${number(j.progress.step)} / ${number(j.progress.total_steps)} steps`],
        ["Samples/s", number(m.samples_per_sec)], ["Loss", number(m.loss, 4)],
        ["Submitted", when(j.created_at)], ["Started", when(j.started_at)], ["Finished", when(j.finished_at)],
        ["Restarts", String(j.restart_count)],
      ];
      if (j.state === "QUEUED") {
        facts.push(["Queue position", String(j.queue_position)], ["Expected start", j.estimated_start_at ? inWords(j.estimated_start_at) : "unknown yet"]);
      }
      if (j.result) facts.push(["Result", resultText(j.result)]);
      $("#job-facts").replaceChildren(...facts.map(([k, v]) => h("div", { class: "card", "data-fact": k }, h("dt", {}, k), h("dd", {}, v))));
      const events = $("#events");
      if (events.children.length !== j.events.length) {
        events.replaceChildren(...j.events.map((e) => h("li", {},
          timeEl(e.time), " ", stateBadge(e.state), " ", h("strong", {}, e.reason), e.message ? `: ${e.message}` : "")));
      }
    }

    poll(async () => {
      job = await api(path);
      renderHead(job);
      const [progress, evals, logs] = await Promise.all([
        api(`${path}/metrics?event=progress&limit=10000`), api(`${path}/metrics?event=eval&limit=10000`),
        api(`${path}/logs?tail=40`, { text: true }).catch((error) => `(logs unavailable: ${error.message})`),
      ]);
      lineChart($("#loss-chart"), [{ name: "loss", points: progress.filter((r) => typeof r.values.loss === "number").map((r) => [r.step, r.values.loss]) }],
        { xLabel: "step", title: "Training loss by step" });
      const evalKeys = ["auc", "rmse", "loss"].filter((k) => evals.some((r) => typeof r.values[k] === "number"));
      lineChart($("#eval-chart"), evalKeys.map((k) => ({ name: `eval ${k}`, points: evals.filter((r) => typeof r.values[k] === "number").map((r) => [r.step, r.values[k]]) })),
        { xLabel: "step", title: "Evaluation metrics by step" });
      const pre = $("#logs");
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      if (pre.textContent !== logs) {
        pre.textContent = logs || "(no output yet)";
        if (atBottom) pre.scrollTop = pre.scrollHeight;
      }
      if (checkpointStep === undefined || job.checkpoint_step !== checkpointStep) {
        checkpointStep = job.checkpoint_step;
        const checkpoints = await api(`${path}/checkpoints`);
        syncTable($("#checkpoints"), {
          label: "Checkpoints", key: (c) => c.uri, rows: checkpoints, empty: "No complete checkpoint yet.",
          columns: [
            { title: "Step", header: true, numeric: true, cell: (c) => number(c.step) },
            { title: "Saved", cell: (c) => timeEl(c.time) },
            { title: "Size", numeric: true, cell: (c) => bytes(c.num_bytes) },
            { title: "URI", cell: (c) => h("code", {}, c.uri) },
          ],
        });
      }
      return !TERMINAL.has(job.state);
    });
  }

  // ------------------------------------------------------------------------------------------ tokens page
  function tokensPage() {
    const tenant = body.dataset.tenant;
    const base = `/v1/tenants/${encodeURIComponent(tenant)}/tokens`;
    const load = async () => {
      const list = await api(base);
      syncTable($("#tokens"), {
        label: "Tokens", key: (t) => t.id, rows: list.items, empty: "No tokens.",
        columns: [
          { title: "Name", header: true, cell: (t) => t.name },
          { title: "Role", cell: (t) => t.role },
          { title: "Starts with", cell: (t) => h("code", {}, `${t.prefix}…`) },
          { title: "Created", cell: (t) => timeEl(t.created_at) },
          { title: "Expires", cell: (t) => t.expires_at ? timeEl(t.expires_at) : "never" },
          { title: "Status", cell: (t) => t.revoked_at ? h("span", {}, "revoked ", timeEl(t.revoked_at)) : "active" },
          { title: "", cell: (t) => t.revoked_at ? "" : h("button", { type: "button", class: "revoke", "data-id": t.id,
              "aria-label": `Revoke token ${t.name}`, onclick: () => revoke(t) }, "Revoke") },
        ],
      });
    };
    async function revoke(t) {
      try {
        await api(`${base}/${t.id}`, { method: "DELETE" });
        $("#live-status").textContent = `Token ${t.name} revoked.`;
      } catch (error) {
        showError(error);
      }
      await load();
    }
    const form = $("#new-token");
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      clearErrors(form);
      const name = form.elements.name.value.trim();
      const expires = form.elements.expires.value;
      try {
        const created = await api(base, { method: "POST", json: {
          name, role: form.elements.role.value, expires_at: expires ? `${expires}T00:00:00Z` : null } });
        $("#created").hidden = false;
        $("#created-name").textContent = created.name;
        $("#created-secret").value = created.token;
        $("#created-secret").select();
        form.reset();
        await load();
      } catch (error) {
        showFieldErrors(form, error, { name: "token-name", expires_at: "token-expires" });
      }
    });
    load().catch(showError);
  }

  // ---------------------------------------------------------------------------------------- inline errors
  function clearErrors(form) {
    for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
    for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
  }

  // A 422's `detail` names each field at fault (loc); its message goes under that field's input.
  function showFieldErrors(form, error, idsByField) {
    const problems = error.errors.length ? error.errors : [{ loc: [], msg: error.message }];
    let first = null;
    for (const problem of problems) {
      const field = [...(problem.loc || [])].reverse().find((part) => idsByField[part]);
      const id = field ? idsByField[field] : Object.values(idsByField)[0];
      const input = form.querySelector(`#${id}`);
      const slot = form.querySelector(`#${id}-error`);
      input.setAttribute("aria-invalid", "true");
      slot.textContent = problem.msg.replace(/^Value error, /, "");
      first = first || input;
    }
    if (first) first.focus();
  }

  // -------------------------------------------------------------------------------------- platform page
  // A quantity ("64Gi") is typed as text; counts and cores as numbers.
  const QUOTA_FIELDS = QUOTA.map((d) => ({ key: d.field, label: d.label, type: d.kind === "bytes" ? "text" : "number" }));

  function adminPage() {
    let sortKey = "name", descending = false, data = null;
    const editing = new Set();
    const columns = [
      { key: "name", title: "Tenant", value: (t) => t.name },
      ...QUOTA.filter((d) => d.used).map((d) => {
        const used = (t) => (d.held ? t.used[d.used] : t[d.used]) ?? 0;
        return { key: d.field, title: `${d.label} used / quota`, value: used,
          show: (t) => `${amount(d, used(t))} / ${t.quota[d.field] ?? "∞"}` };
      }),
      { key: "wait", title: "Avg wait (7 d)", value: (t) => t.avg_queue_wait_s_7d ?? -1, show: (t) => duration(t.avg_queue_wait_s_7d) },
    ];

    function render() {
      const c = data.capacity, q = data.sum_of_quotas, u = data.used;
      const rows = [
        ...HELD.map((d) => [d.label, u[d.used], q[d.used], c[d.used], (v) => amount(d, v)]),
        ["Trainer processes", null, null, c.processes, number],  // the backend's own (the local backend's slots)
      ];
      syncTable($("#capacity"), {
        label: "Capacity against the sum of quotas", key: (r) => r[0], rows, empty: "",
        columns: [
          { title: "Resource", header: true, cell: (r) => r[0] },
          { title: "Used now", numeric: true, cell: (r) => r[1] === null ? "—" : r[4](r[1]) },
          { title: "Sum of quotas", numeric: true, cell: (r) => r[2] === null ? "unlimited" : r[4](r[2]) },
          { title: "Capacity", numeric: true, cell: (r) => r[3] === null ? "not bounded by kembed" : r[4](r[3]) },
          { title: "Quotas / capacity", numeric: true, cell: (r) => r[2] !== null && r[3] ? `${number((100 * r[2]) / r[3])} %` : "—" },
        ],
      });
      const table = renderTenantTable();
      $("#tenants").replaceChildren(table);
    }

    function renderTenantTable() {
      const sorted = [...data.tenants].sort((a, b) => {
        const col = columns.find((c) => c.key === sortKey);
        const [x, y] = [col.value(a), col.value(b)];
        const order = typeof x === "string" ? x.localeCompare(y) : x - y;
        return descending ? -order : order;
      });
      return h("table", { class: "tenants" },
        h("caption", { class: "visually-hidden" }, "Tenants, sortable"),
        h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", "aria-sort": c.key === sortKey ? (descending ? "descending" : "ascending") : null },
          h("button", { type: "button", class: "sort", "data-sort": c.key, onclick: () => {
            descending = sortKey === c.key ? !descending : false;
            sortKey = c.key;
            render();
            document.querySelector(`button[data-sort="${c.key}"]`).focus();
          } }, c.title))), h("th", { scope: "col" }, "Quota"))),
        h("tbody", {}, sorted.flatMap((t) => {
          const row = h("tr", { "data-tenant": t.name },
            columns.map((c, i) => i === 0 ? h("th", { scope: "row" }, t.name) : h("td", { "data-col": c.key }, c.show(t))),
            h("td", {}, h("button", { type: "button", class: "edit", "aria-expanded": String(editing.has(t.name)),
              "aria-controls": `quota-${t.name}`, "aria-label": `Edit quota of ${t.name}`, onclick: () => {
                if (editing.has(t.name)) editing.delete(t.name); else editing.add(t.name);
                render();
                const input = document.querySelector(`#quota-${t.name}-gpus`);
                if (input) input.focus();
              } }, editing.has(t.name) ? "Close" : "Edit")));
          return editing.has(t.name) ? [row, h("tr", { class: "editor" }, h("td", { colspan: columns.length + 1 }, quotaForm(t)))] : [row];
        })));
    }

    function quotaForm(t) {
      const ids = {};
      const form = h("form", { id: `quota-${t.name}`, class: "inline-form", novalidate: true,
        "aria-label": `Quota of ${t.name}` },
        QUOTA_FIELDS.map((f) => {
          const id = ids[f.key] = `quota-${t.name}-${f.key}`;
          return h("div", { class: "field" },
            h("label", { for: id }, f.label),
            h("input", { id, name: f.key, value: t.quota[f.key] ?? "", inputmode: f.type === "text" ? null : "decimal",
              placeholder: "unlimited", "aria-describedby": `${id}-error` }),
            h("p", { class: "field-error", id: `${id}-error` }));
        }),
        h("button", { type: "submit" }, "Save quota"));
      form.addEventListener("submit", async (event) => {
        event.preventDefault();
        clearErrors(form);
        const quota = {};
        for (const f of QUOTA_FIELDS) {
          const raw = form.elements[f.key].value.trim();
          // Sent as typed: the API validates and names the field at fault (shown under it).
          quota[f.key] = raw === "" ? null : f.type === "text" || Number.isNaN(Number(raw)) ? raw : Number(raw);
        }
        try {
          await api(`/v1/tenants/${encodeURIComponent(t.name)}`, { method: "PATCH", json: { quota } });
          editing.delete(t.name);
          $("#live-status").textContent = `Quota of ${t.name} saved.`;
          await load();
        } catch (error) {
          showFieldErrors(form, error, ids);
        }
      });
      return form;
    }

    const load = async () => {
      data = await api("/v1/cluster");
      if (!editing.size) render();  // a refresh never wipes a quota being typed
    };
    poll(load, 5000);
  }

  const pages = { team: teamPage, history: historyPage, job: jobPage, tokens: tokensPage, admin: adminPage };
  if (pages[PAGE]) pages[PAGE]();
})();
