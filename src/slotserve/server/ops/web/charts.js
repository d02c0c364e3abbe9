// Canvas drawing for the dashboard: rolling time series and the KV pool map. No library:
// a few axes, lines and rectangles are all the page needs.

export const CLASS_COLORS = { interactive: "#2563eb", normal: "#059669", background: "#d97706" };
const OWNER_COLORS = ["#2563eb", "#d97706", "#059669", "#db2777", "#7c3aed", "#0891b2", "#65a30d", "#dc2626"];
const FREE = "#e5e7eb";
const RESERVED = "#9ca3af";
const CACHED = "#a78bfa";
const SHARED = "#111827";
const AHEAD_ALPHA = 0.35;
const AXIS = "#6b7280";

export function ownerColor(slot) {
  return OWNER_COLORS[slot % OWNER_COLORS.length];
}

/** The canvas's 2D context, sized to its CSS box at the screen's pixel ratio. */
function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = cssHeight ?? canvas.clientHeight;
  canvas.style.height = `${height}px`;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  context.font = "11px system-ui, sans-serif";
  return { context, width, height };
}

/** A round upper bound for an axis: 1, 2 or 5 times a power of ten. */
function niceCeiling(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((step) => step >= value);
}

/**
 * Samples of each class over the last ``windowS`` seconds before ``now``, as points joined
 * by lines. ``series`` maps a class to [[t, milliseconds], ...] in time order.
 */
export function drawTimeSeries(canvas, series, { now, windowS, empty }) {
  const { context, width, height } = fitCanvas(canvas, 150);
  const left = 44, right = 8, top = 8, bottom = 20;
  const plotW = width - left - right, plotH = height - top - bottom;
  const visible = Object.entries(series).map(([k, points]) => [k, points.filter(([t]) => t >= now - windowS)]);
  const highest = Math.max(0, ...visible.flatMap(([, points]) => points.map(([, v]) => v)));
  const top_ms = niceCeiling(highest * 1.1);
  const x = (t) => left + ((t - (now - windowS)) / windowS) * plotW;
  const y = (v) => top + plotH - (v / top_ms) * plotH;

  context.strokeStyle = "#f3f4f6";
  context.fillStyle = AXIS;
  context.textAlign = "right";
  for (let i = 0; i <= 4; i += 1) {
    const value = (top_ms * i) / 4;
    context.beginPath();
    context.moveTo(left, y(value));
    context.lineTo(width - right, y(value));
    context.stroke();
    context.fillText(value >= 1000 ? `${value / 1000} s` : `${value} ms`, left - 4, y(value) + 4);
  }
  for (let i = 0; i <= 4; i += 1) {
    const ago = Math.round((windowS * (4 - i)) / 4);
    context.textAlign = i === 0 ? "left" : i === 4 ? "right" : "center";
    context.fillText(ago ? `-${ago}s` : "now", x(now - ago), height - 5);
  }
  context.textAlign = "center";
  if (!visible.some(([, points]) => points.length)) {
    context.fillText(empty, left + plotW / 2, top + plotH / 2);
    return;
  }
  for (const [cls, points] of visible) {
    context.strokeStyle = context.fillStyle = CLASS_COLORS[cls] || AXIS;
    context.lineWidth = 1.5;
    context.beginPath();
    points.forEach(([t, v], i) => (i ? context.lineTo(x(t), y(v)) : context.moveTo(x(t), y(v))));
    context.stroke();
    for (const [t, v] of points) context.fillRect(x(t) - 2, y(v) - 2, 4, 4);
  }
}

/** Cell layout: one square a block, at its id in the pool (the pool's own block tables).
 *  A running request's blocks are in its slot's colour (faded: reserved ahead, not yet
 *  written), blocks only the prefix cache holds in violet, free ones grey; a block more
 *  than one table holds (shared copy-on-write) is outlined. */
function drawBlocks(canvas, kv) {
  const width = canvas.clientWidth;
  const cell = kv.total > 1024 ? 6 : 10, gap = 2, pitch = cell + gap;
  const columns = Math.max(1, Math.floor((width + gap) / pitch));
  const rows = Math.ceil(kv.total / columns);
  const { context } = fitCanvas(canvas, Math.max(pitch, rows * pitch));
  const fills = new Array(kv.total).fill(null);
  for (const snapshot of kv.snapshots) for (const block of snapshot.blocks) fills[block] = [CACHED, 1];
  for (const owner of kv.owners) {
    const color = ownerColor(owner.slot);
    owner.blocks.forEach((block, i) => (fills[block] = [color, i < owner.written ? 1 : AHEAD_ALPHA]));
  }
  const shared = new Set(kv.shared.map(([block]) => block));
  fills.forEach((fill, i) => {
    const [color, alpha] = fill || [FREE, 1];
    const x = (i % columns) * pitch, y = Math.floor(i / columns) * pitch;
    context.globalAlpha = alpha;
    context.fillStyle = color;
    context.fillRect(x, y, cell, cell);
    context.globalAlpha = 1;
    if (shared.has(i)) {
      context.strokeStyle = SHARED;
      context.lineWidth = 1.5;
      context.strokeRect(x + 0.75, y + 0.75, cell - 1.5, cell - 1.5);
    }
  });
}

/** Flat and ring layouts: one bar a slot row (a stripe for each flat or ring layer group),
 *  filled to the cells its owner's live positions occupy. */
function drawRows(canvas, kv, slotCount) {
  const rowH = 16, gap = 4, label = 48;
  const { context, width } = fitCanvas(canvas, slotCount * (rowH + gap));
  const groups = kv.rows;
  const stripe = rowH / Math.max(1, groups.length);
  const inset = groups.length > 1 ? 1 : 0;
  const bySlot = new Map(kv.owners.map((owner) => [owner.slot, owner]));
  const parked = new Map(kv.snapshots.filter((s) => s.slot !== null).map((s) => [s.slot, s]));
  for (let slot = 0; slot < slotCount; slot += 1) {
    const y0 = slot * (rowH + gap);
    const owner = bySlot.get(slot);
    context.fillStyle = AXIS;
    context.textAlign = "left";
    context.fillText(`slot ${slot}`, 0, y0 + 12);
    groups.forEach((group, g) => {
      const y = y0 + g * stripe;
      context.fillStyle = owner ? RESERVED : FREE;
      context.fillRect(label, y, width - label, stripe - inset);
      const kept = !owner && parked.get(slot);
      if (kept) {  // a parked slot: its rows hold the finished request's positions
        context.fillStyle = CACHED;
        context.fillRect(label, y, ((width - label) * Math.min(kept.tokens, group.size)) / group.size, stripe - inset);
      }
      if (!owner) return;
      context.fillStyle = ownerColor(slot);
      context.fillRect(label, y, ((width - label) * owner.rows[g].live) / group.size, stripe - inset);
    });
    if (owner && owner.rows.some((row) => row.wrapped)) {
      context.fillStyle = "#ffffff";
      context.fillText("↻ wrapped", width - 64, y0 + 12);
    }
  }
}

/** The KV pool as its layout holds it. */
export function drawKvMap(canvas, kv, slotCount) {
  if (kv.unit === "blocks") drawBlocks(canvas, kv);
  else drawRows(canvas, kv, slotCount);
}
