// The live dashboard: one SSE feed (/dashboard/events) of engine snapshots, drawn as tiles,
// the slot table, the KV pool map, per-class latency charts, the memory plan and the
// Prometheus latency summary. It keeps the last minute of samples; the server keeps none.

import { CLASS_COLORS, drawKvMap, drawTimeSeries, ownerColor } from "./charts.js";
import { escapeHtml } from "./markdown.js";
import { readEvents } from "./sse.js";

const WINDOW_S = 60; // samples kept, and the charts' widest span
const MIN_WINDOW_S = 15; // the charts' span while the page is younger than WINDOW_S
const RETRY_MS = 2000;

function bytes(n) {
  if (n === null || n === undefined) return "–";
  for (const [unit, size] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (Math.abs(n) >= size) return `${(n / size).toFixed(1)} ${unit}`;
  }
  return `${n} B`;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds >= 1 ? `${seconds.toFixed(2)} s` : `${(seconds * 1000).toFixed(1)} ms`;
}

// The declared worst-case cancel→release time (`Engine.cancel_bound`): one step of the
// largest size the config allows, timed once such steps were measured.
function boundText(bound) {
  if (!bound) return "";
  if (bound.estimate_s === null) return `bound: one ${bound.max_step_tokens}-token step`;
  return `bound ${ms(bound.estimate_s)} (${bound.max_step_tokens}-token step, ${bound.basis})`;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

export class Dashboard {
  constructor(root, fetchWithKey) {
    this.root = root;
    this.fetch = fetchWithKey;
    this.itl = {}; // class -> [[t, ms], ...] for the last WINDOW_S seconds
    this.ttft = {};
    this.latest = null;
    this.since = null; // engine time of the first snapshot this page saw
    window.addEventListener("resize", () => this.latest && this.render(this.latest));
  }

  /** Follow the feed; reconnect after a drop (a restarted server, a network blip). */
  async connect() {
    for (;;) {
      try {
        const response = await this.fetch("/dashboard/events");
        if (response.ok) {
          this.status("live");
          for await (const data of readEvents(response)) {
            const snapshot = JSON.parse(data);
            if (snapshot.type === "closed") break;
            this.take(snapshot);
          }
        }
      } catch (error) {
        console.warn("dashboard feed:", error);
      }
      this.status("offline");
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
      this.status("connecting");
    }
  }

  status(state) {
    const pill = document.getElementById("feed-status");
    pill.dataset.state = state;
    pill.textContent = state;
  }

  take(snapshot) {
    for (const [series, samples] of [[this.itl, snapshot.samples.itl], [this.ttft, snapshot.samples.ttft]]) {
      for (const [cls, values] of Object.entries(samples)) {
        series[cls] = (series[cls] || []).concat(values.map((v) => [snapshot.t, v * 1000]));
      }
      for (const cls of Object.keys(series)) {
        series[cls] = series[cls].filter(([t]) => t >= snapshot.t - WINDOW_S);
      }
    }
    this.latest = snapshot;
    this.render(snapshot);
  }

  /** The charts' span: the page's age, between MIN_WINDOW_S and WINDOW_S. */
  windowS(now) {
    if (this.since === null) this.since = now;
    return Math.min(WINDOW_S, Math.max(MIN_WINDOW_S, Math.ceil(now - this.since)));
  }

  render(s) {
    const windowS = this.windowS(s.t);
    this.renderTiles(s);
    this.renderSlots(s.slots);
    this.renderKv(s);
    drawTimeSeries(document.getElementById("itl-chart"), this.itl, { now: s.t, windowS, empty: "no tokens yet" });
    drawTimeSeries(document.getElementById("ttft-chart"), this.ttft, { now: s.t, windowS, empty: "no requests yet" });
    this.renderClassLegend();
    this.renderPlan(s.plan);
    if (s.models) this.renderModels(s.models);
    this.renderLatency(s.latency);
    setText("build-cost", `this snapshot took ${s.build_ms.toFixed(2)} ms to build.`);
  }

  renderTiles(s) {
    const st = s.stats;
    setText("tile-slots", `${st.slots_in_use} / ${st.max_seqs}`);
    setText("tile-queue", String(st.queue_len));
    setText("kv-unit", s.kv.unit);
    // Parked: held by the prefix cache alone (a finished request's slot or blocks), in the
    // used count but reclaimable, so a pool at rest reads "0 held", not a leak.
    const parked = st.kv_blocks_parked || 0;
    const parkedNote = parked ? ` (${parked} parked, reclaimable)` : "";
    setText("tile-kv", `${s.kv.used} / ${s.kv.total}${parkedNote}`);
    const tile = document.getElementById("tile-kv");
    tile.dataset.used = String(s.kv.used);
    tile.dataset.cached = String(s.kv.cached || 0);
    tile.dataset.parked = String(parked);
    const p = s.pressure;
    const pressure = document.getElementById("tile-pressure");
    pressure.textContent = p.level === null ? "off" : `${p.level.toFixed(2)} / ${p.threshold}`;
    setText("tile-pressure-note", p.level === null ? "no signal" : p.under ? "background paused" : "");
    pressure.classList.toggle("hot", p.under);
    setText("tile-cancel", String(st.cancellations));
    const cancel = s.latency.cancel;
    const measured =
      cancel && cancel.count
        ? `→ release: mean ${ms(cancel.mean)}` + (s.latency.cancel_recent !== null ? `, last ${ms(s.latency.cancel_recent)}` : "")
        : "";
    setText("tile-cancel-note", [measured, boundText(st.cancel_bound)].filter(Boolean).join("; "));
    const refusals = Object.entries(st.refusals);
    setText("tile-refused", String(refusals.reduce((n, [, count]) => n + count, 0)));
    setText("tile-refused-note", refusals.map(([reason, count]) => `${reason} ${count}`).join(", "));
    setText("policy", `policy ${s.policy} · ${st.steps} steps · ${st.admitted} admitted`);
  }

  renderSlots(slots) {
    const body = this.root.querySelector("#slots tbody");
    body.innerHTML = slots
      .map((slot) => {
        if (slot.state === "idle" && slot.parked) {
          return (
            `<tr data-state="idle" data-parked="true"><td>${slot.slot}</td>` +
            `<td><span class="badge idle">idle</span> <span class="badge parked">parked</span></td>` +
            `<td colspan="5" class="muted">${slot.parked_tokens} tokens kept for the prefix cache</td></tr>`
          );
        }
        if (slot.state === "idle") {
          return `<tr data-state="idle"><td>${slot.slot}</td><td><span class="badge idle">idle</span></td><td colspan="5"></td></tr>`;
        }
        const cls = escapeHtml(slot.class);
        return (
          `<tr data-state="${slot.state}" data-class="${cls}">` +
          `<td><span class="swatch" style="background:${ownerColor(slot.slot)}"></span>${slot.slot}</td>` +
          `<td><span class="badge ${slot.state}">${slot.state}</span></td>` +
          `<td><span class="badge" style="color:${CLASS_COLORS[slot.class] || "inherit"}">${cls}</span></td>` +
          `<td>#${slot.request_id}</td><td>${slot.prompt_tokens}</td><td>${slot.generated_tokens}</td>` +
          `<td>${slot.age_s.toFixed(1)} s</td></tr>`
        );
      })
      .join("");
  }

  renderKv(s) {
    const kv = s.kv;
    drawKvMap(document.getElementById("kv-map"), kv, s.stats.max_seqs);
    const rows = kv.rows.map((g) => `${g.size} positions (${g.kind}, ${g.layers.length} layers)`).join(" + ");
    const shape =
      kv.unit === "blocks"
        ? `${kv.layout}, ${kv.block_size} tokens a block` + (rows ? `; a slot's row: ${rows}` : "")
        : `${kv.layout}; a slot's row: ${rows}`;
    setText("kv-caption", `${shape} · ${bytes(s.plan.kv_pool_bytes)}`);
    const blocks = kv.unit === "blocks";
    const owners = kv.owners.map(
      (o) =>
        `<span><i style="background:${ownerColor(o.slot)}"></i>slot ${o.slot} · #${o.request_id} · ` +
        `${escapeHtml(o.class || "")} · ${o.tokens} tok${blocks ? ` · ${o.blocks.length} blocks` : ""}</span>`,
    );
    if (blocks) {
      owners.push(
        `<span><i class="ahead"></i>reserved ahead (${kv.reserved})</span>`,
        `<span><i class="shared"></i>shared, copy-on-write (${kv.shared.length})</span>`,
        `<span><i class="cached"></i>prefix cache only (${kv.cached})</span>`,
      );
    } else {
      owners.push(
        `<span><i class="reserved"></i>held, not yet written</span>`,
        `<span><i class="cached"></i>parked for the prefix cache (${kv.cached})</span>`,
      );
    }
    owners.push(`<span><i class="free"></i>free (${kv.free})</span>`);
    this.root.querySelector("#kv-legend").innerHTML = owners.join("");
  }

  renderClassLegend() {
    this.root.querySelector("#class-legend").innerHTML = Object.entries(CLASS_COLORS)
      .map(([cls, color]) => `<span><i style="background:${color}"></i>${cls}</span>`)
      .join("");
  }

  renderPlan(plan) {
    const limits = plan.memory_map || {};
    const total = plan.memory_budget || plan.worst_case_bytes;
    const rows = Object.entries(plan.arenas).map(([arena, used]) => {
      const limit = limits[arena] || total;
      const share = Math.min(100, (100 * used) / limit);
      return (
        `<div class="bar-row"><span class="name">${arena}</span>` +
        `<span class="bar"><span class="fill ${arena}" style="width:${share}%"></span></span>` +
        `<span class="num">${bytes(used)}${plan.memory_map ? ` / ${bytes(limit)}` : ""}</span></div>`
      );
    });
    const budget = plan.memory_budget
      ? `worst case ${bytes(plan.worst_case_bytes)} of a ${bytes(plan.memory_budget)} budget (headroom ${bytes(plan.headroom_bytes)})`
      : plan.memory_map
        ? `per-arena budgets; headroom ${bytes(plan.headroom_bytes)}`
        : `worst case ${bytes(plan.worst_case_bytes)}; no budget set (bars are shares of the worst case)`;
    const levers = `max_seqs ${plan.max_seqs} × ${bytes(plan.bytes_per_session)} KV a session at max_context ${plan.max_context}`;
    this.root.querySelector("#plan").innerHTML =
      rows.join("") + `<p class="note">${budget}.<br>${levers}.</p>`;
  }

  // A server of several models: each model's state (loaded, loading, unloaded), kind,
  // planned bytes and slots, under the device plan's one budget (docs/MODELS.md).
  renderModels(models) {
    const rows = models.cards.map((m) => {
      const slots = m.slots ? ` · ${m.slots.in_use}/${m.slots.max} slots, queue ${m.slots.queue}` : "";
      return (
        `<div class="bar-row"><span class="name">${m.id}</span>` +
        `<span>${m.state}${m.progress && m.state === "loading" ? " …" : ""} · ${m.kind}` +
        `${m.resident ? "" : " · on demand"}${slots}</span>` +
        `<span class="num">${bytes(m.bytes)}</span></div>`
      );
    });
    const budget = models.budget ? ` of ${bytes(models.budget)}` : " (no budget)";
    this.root.querySelector("#plan").insertAdjacentHTML(
      "beforeend",
      `<h3>Models</h3>${rows.join("")}<p class="note">device plan ${bytes(models.used)}${budget}.</p>`,
    );
  }

  renderLatency(latency) {
    const names = { ttft: "TTFT", itl: "ITL", queue: "queue", cancel: "cancel→release" };
    this.root.querySelector("#latency tbody").innerHTML = Object.entries(names)
      .filter(([key]) => latency[key])
      .map(([key, label]) => {
        const h = latency[key];
        return `<tr><td>${label}</td><td>${h.count}</td><td>${ms(h.mean)}</td><td>${ms(h.p50)}</td><td>${ms(h.p95)}</td></tr>`;
      })
      .join("");
  }
}
