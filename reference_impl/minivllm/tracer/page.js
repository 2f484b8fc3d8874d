// The step page of `minivllm-trace render TRACE -o steps.html` (notebook.py):
// draws the step under the slider from the page's compact data, so the page
// holds each block-table layout once instead of a diagram per step.
//
// data (built by notebook.page_data):
//   gpu_blocks, cpu_blocks, block_size, columns, max_pool_cells, colors
//   layouts: distinct block-table states, each [[seq id, request id, status,
//            [blocks]], ...] (a swapped sequence's blocks are CPU blocks)
//   queues:  distinct [waiting, running, swapped] request-id lists
//   steps:   per step {n, layout, queues, lens: [[num_tokens, num_computed],
//            ...] in layout order, tokens, free: [gpu, cpu], about}
//
// stepHtml(data, i) is a pure function of the data, so it runs under Node
// too (tests/test_tracer_views.py); the wiring at the end needs a browser.

"use strict";

function esc(text) {
  const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return String(text).replace(/[&<>"']/g, (c) => entities[c]);
}

function seqColor(data, seq) {
  return data.colors[seq % data.colors.length];
}

// pool -> block -> the seq ids that map it, in table order.
function owners(layout) {
  const out = { gpu: new Map(), cpu: new Map() };
  for (const [seq, , status, table] of layout) {
    const pool = out[status === "swapped" ? "cpu" : "gpu"];
    for (const block of table) {
      if (!pool.has(block)) pool.set(block, []);
      pool.get(block).push(seq);
    }
  }
  return out;
}

function queuesHtml(queues) {
  const rows = ["waiting", "running", "swapped"].map(
    (name, i) => `<tr><td>${name}</td><td>${esc(queues[i].join(" ") || "-")}</td></tr>`
  );
  return `<table class="queues"><caption>queues after the step</caption>${rows.join("")}</table>`;
}

function seqHtml(data, [seq, request, status, table], [numTokens, numComputed]) {
  const color = seqColor(data, seq);
  const cells = table.map(
    (block, i) => `<td style="background: ${color}">L${i} → ${block}</td>`
  );
  const title =
    `seq ${seq} · ${esc(request)} · ${status} · ` +
    `${numTokens} tokens (${numComputed} in cache)`;
  return (
    `<table class="seq" data-seq="${seq}"><caption>${title}</caption>` +
    `<tr>${cells.join("")}</tr></table>`
  );
}

function poolHtml(data, pool, title, blocks, owned) {
  const cells = blocks.map((block) => {
    const seqs = owned.get(block) || [];
    const name = `${pool} block ${block}`;
    if (!seqs.length) return `<td title="${name}: free">${block}</td>`;
    const who = seqs.map((s) => `seq ${s}`).join(", ");
    const text = seqs.length > 1 ? `${block} ×${seqs.length}` : `${block}`;
    return (
      `<td title="${name}: ${who}" data-seqs=" ${seqs.join(" ")} " ` +
      `style="background: ${seqColor(data, seqs[0])}">${text}</td>`
    );
  });
  const rows = [];
  for (let i = 0; i < cells.length; i += data.columns) {
    rows.push(`<tr>${cells.slice(i, i + data.columns).join("")}</tr>`);
  }
  return `<table class="pool"><caption>${title}</caption>${rows.join("")}</table>`;
}

function stepHtml(data, i) {
  const step = data.steps[i];
  const layout = data.layouts[step.layout];
  const owned = owners(layout);
  const parts = [
    `<p class="title">step ${step.n}: ${step.tokens} tokens in the batch; free blocks: ` +
      `gpu ${step.free[0]}/${data.gpu_blocks}, cpu ${step.free[1]}/${data.cpu_blocks}</p>`,
    `<p>${esc(step.about)}</p>`,
    queuesHtml(data.queues[step.queues]),
  ];
  layout.forEach((entry, k) => parts.push(seqHtml(data, entry, step.lens[k])));
  // Every device block, or only those in use in a pool too large to draw.
  const used = [...owned.gpu.keys()].sort((a, b) => a - b);
  const all = Array.from({ length: data.gpu_blocks }, (_, b) => b);
  const gpu = data.gpu_blocks <= data.max_pool_cells ? all : used;
  const title = `device (gpu) pool: ${data.gpu_blocks} blocks of ${data.block_size} tokens`;
  parts.push(poolHtml(data, "gpu", title, gpu, owned.gpu));
  if (owned.cpu.size) {
    const cpu = [...owned.cpu.keys()].sort((a, b) => a - b);
    parts.push(poolHtml(data, "cpu", "CPU swap pool: blocks in use", cpu, owned.cpu));
  }
  return parts.join("\n");
}

// Hovering a sequence outlines its blocks in the pools.
function lightBlocks(view, seq) {
  for (const cell of view.querySelectorAll("td[data-seqs]")) {
    cell.classList.toggle("lit", seq !== null && cell.dataset.seqs.includes(` ${seq} `));
  }
}

if (typeof document !== "undefined") {
  const data = JSON.parse(document.getElementById("trace-data").textContent);
  const slider = document.getElementById("slider");
  const view = document.getElementById("view");
  const show = () => {
    view.innerHTML = stepHtml(data, Number(slider.value));
    document.getElementById("label").textContent = data.steps[slider.value].n;
  };
  view.addEventListener("mouseover", (event) => {
    const table = event.target.closest("table.seq");
    lightBlocks(view, table ? table.dataset.seq : null);
  });
  slider.addEventListener("input", show);
  if (data.steps.length) show();
  else view.textContent = "This trace has no steps.";
}

if (typeof module !== "undefined") module.exports = { stepHtml };
