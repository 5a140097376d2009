"""A self-contained HTML page to step through a trace (no external assets: CSS, JS and data inline).

The frames are computed here (viz/replay.py), so the page only draws them: per frame a string with one
state code per response position, the slots planned and the positions committed that round.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

from refusion.viz.replay import HOW_LABELS, describe_round, frames, round_counts, summary_parts
from refusion.viz.schema import TraceDocument, check_writable

STATE_CODES = {"hidden": "h", "masked": "m", "dropped": "x", "fast_accept": "f", "parallel_completion": "p",
               "speculative": "s", "autoregressive": "a"}


def page_data(doc: TraceDocument, sequences: list[int] | None = None) -> dict:
    """What the page's script draws: per sequence, final cells and one compact entry per frame."""
    chosen = [doc.sequences[i] for i in sequences] if sequences is not None else doc.sequences
    out = []
    for seq in chosen:
        seq_frames = frames(seq, doc.settings)
        final = seq_frames[-1].cells if seq_frames else []
        out.append({
            "index": seq.index, "prompt": seq.prompt, "response": seq.response, "prompt_length": seq.prompt_length,
            "finish_reason": seq.finish_reason, "stats": seq.stats, "counts": round_counts(seq),
            "summary": [text for text, _ in summary_parts(seq)],
            "cells": [{"text": c.text, "round": c.round, "slot": c.slot, "score": c.score, "draft": c.draft,
                       "how": c.state if c.state in HOW_LABELS else None} for c in final],
            "frames": [{"line": describe_round(seq, f.round, len(seq_frames)), "how": f.round.how,
                        "states": "".join(STATE_CODES[c.state] for c in f.cells),
                        "planned": {str(i): list(v) for i, v in f.planned.items()},
                        "committed": sorted(f.committed), "tokens": f.tokens, "forwards": f.forwards}
                       for f in seq_frames],
        })
    return {"model": doc.model, "settings": doc.settings, "version": doc.version, "sequences": out,
            "labels": HOW_LABELS}


def render_html(doc: TraceDocument, sequences: list[int] | None = None, title: str | None = None) -> str:
    """The page as one string."""
    data = json.dumps(page_data(doc, sequences), ensure_ascii=False)
    # inside <script>: never let the data close the tag or open a comment
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = title or f"ReFusion decoding trace ({doc.model or 'model'})"
    return (PAGE.replace("__TITLE__", html.escape(title)).replace("__STYLE__", STYLE)
            .replace("__SCRIPT__", SCRIPT).replace("__DATA__", data))


def save_html(doc: TraceDocument, path: str | os.PathLike, sequences: list[int] | None = None) -> Path:
    path = Path(path)
    check_writable(path)
    path.write_text(render_html(doc, sequences), encoding="utf-8")
    return path


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__STYLE__</style>
</head>
<body>
<header>
  <h1>__TITLE__</h1>
  <div id="settings"></div>
</header>
<nav>
  <label id="seq-label">sequence <select id="seq"></select></label>
  <button id="first" title="first round (Home)">&#x23EE;</button>
  <button id="prev" title="previous round (&#x2190;)">&#x25C0;</button>
  <button id="play" title="play / pause (space)">&#x25B6;</button>
  <button id="next" title="next round (&#x2192;)">&#x25B6;&#x25B6;</button>
  <button id="last" title="last round (End)">&#x23ED;</button>
  <input id="slider" type="range" min="0" max="0" value="0">
  <span id="counter"></span>
</nav>
<main>
  <div id="prompt"></div>
  <div id="line"></div>
  <div id="canvas" class="canvas"></div>
  <div id="info">hover a slot for its plan score, drafts and round</div>
  <div id="legend">
    <span class="cell st-f now">fast accept</span> <span class="cell st-p now">parallel completion</span>
    <span class="cell st-s now">speculative (exact)</span> <span class="cell st-a now">autoregressive</span> <span class="cell st-m planned">draft sent back</span>
    <span class="cell st-m">&#xB7;&#xB7;&#xB7; masked</span> <span class="cell st-x">dropped after EOS</span>
    <span class="hint">bright: committed this round; pale: earlier rounds</span>
  </div>
  <div id="stats"></div>
  <table id="rounds"><thead><tr><th>round</th><th>what happened</th></tr></thead><tbody></tbody></table>
</main>
<script type="application/json" id="trace-data">__DATA__</script>
<script>__SCRIPT__</script>
</body>
</html>
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
h1 { font-size: 1.2em; margin: 0 0 .2em 0; }
#settings, #line, .hint { color: #666; font-size: .9em; }
nav { margin: 1em 0; display: flex; gap: .4em; align-items: center; flex-wrap: wrap; }
nav input[type=range] { flex: 1; min-width: 10em; }
#prompt { font-weight: bold; color: #06c; margin-bottom: .3em; white-space: pre-wrap; }
.canvas { font-family: ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace; font-size: 1.05em;
          line-height: 1.9; background: #fff; border: 1px solid #ddd; padding: .6em; border-radius: 4px; }
.cell { white-space: pre; padding: 1px 0; border-radius: 2px; }
.slot-start { margin-left: 2px; }
.st-m { color: #aaa; }
.st-x { color: #ccc; background: repeating-linear-gradient(45deg, #f3f3f3, #f3f3f3 3px, #fff 3px, #fff 6px); }
.st-f { background: #d5f5d5; } .st-f.now { background: #2eb82e; color: #fff; }
.st-p { background: #d6e6ff; } .st-p.now { background: #1f6fe0; color: #fff; }
.st-s { background: #eadcfa; } .st-s.now { background: #8a3fd1; color: #fff; }
.st-a { background: #ffe6c7; } .st-a.now { background: #f08c00; color: #fff; }
.planned { color: #a07800; background: #fff4b8; font-style: italic; }
.hover { outline: 2px solid #e0409a; }
#info { min-height: 2.6em; margin: .5em 0; font-size: .9em; color: #333; white-space: pre-wrap; }
#legend .cell { padding: 1px 4px; font-size: .85em; }
#stats { margin: .8em 0; font-size: .95em; }
#rounds { border-collapse: collapse; font-size: .85em; margin-top: .5em; }
#rounds td, #rounds th { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eee; }
#rounds tr { cursor: pointer; } #rounds tr.current { background: #fff4b8; }
"""

SCRIPT = r"""
(function () {
  const data = JSON.parse(document.getElementById("trace-data").textContent);
  const $ = (id) => document.getElementById(id);
  let seqIndex = 0, frameIndex = 0, timer = null;
  const showText = (t) => t === "" ? "\u2205" : t.replace(/\r/g, "").replace(/\n/g, "\u21B5").replace(/\t/g, "\u21E5");
  const fmt = (x) => (x === null || x === undefined) ? "-" : Number(x).toFixed(3);
  const s = data.settings;
  $("settings").textContent = ["strategy " + s.strategy, "k " + s.slot_size, "b " + s.block_size,
    "\u03C4_slot " + s.slot_threshold, "\u03C4_token " + s.token_threshold, "T " + s.temperature,
    "max_new_tokens " + s.max_new_tokens, "model " + (data.model || "?")].join(" \u00B7 ");
  data.sequences.forEach((q, i) => {
    const o = document.createElement("option");
    o.value = i; o.textContent = "[" + q.index + "] " + q.prompt.slice(0, 60);
    $("seq").appendChild(o);
  });
  if (data.sequences.length < 2) $("seq-label").style.display = "none";

  function seq() { return data.sequences[seqIndex]; }

  function describeCell(q, f, i) {
    const c = q.cells[i], st = f.states[i];
    const lines = ["offset " + i + " (position " + (q.prompt_length + i) + ")"];
    if (f.planned[i] && st === "m") {
      const [slot, draft, score] = f.planned[i];
      lines.push("slot @" + slot + " planned this round, score " + fmt(score) + ", draft \"" + showText(draft) +
                 "\": not accepted, masked again");
    } else if ("fpsa".includes(st)) {
      lines.push("\"" + showText(c.text) + "\" committed in round " + (c.round + 1) + " by " + data.labels[c.how] +
                 (c.slot !== null ? ", slot @" + c.slot : "") + (c.score !== null ? ", plan score " + fmt(c.score) : "") +
                 (c.draft !== null && c.draft !== undefined && c.draft !== c.text ? ", drafted as \"" + showText(c.draft) + "\"" : ""));
    } else if (st === "x") {
      lines.push("never decoded: the sequence ended (EOS) before it");
    } else {
      lines.push("masked");
    }
    return lines.join("\n");
  }

  function slotOf(q, f, i) {
    if (f.planned[i] && f.states[i] === "m") return "p" + f.planned[i][0];
    const c = q.cells[i];
    return "fpsa".includes(f.states[i]) && c.slot !== null ? "c" + c.slot + "r" + c.round : "i" + i;
  }

  function render() {
    const q = seq(), n = q.frames.length;
    frameIndex = Math.max(0, Math.min(frameIndex, n - 1));
    $("slider").max = Math.max(0, n - 1); $("slider").value = frameIndex;
    $("counter").textContent = n ? "round " + (frameIndex + 1) + " / " + n : "no rounds";
    $("prompt").textContent = q.prompt;
    const canvas = $("canvas"); canvas.textContent = "";
    if (!n) { $("line").textContent = "this sequence has no rounds"; return; }
    const f = q.frames[frameIndex], committed = new Set(f.committed);
    $("line").textContent = f.line + " \u00B7 " + f.tokens + " tokens, " + f.forwards + " forwards so far";
    let lastSlot = null;
    for (let i = 0; i < f.states.length; i++) {
      const st = f.states[i];
      if (st === "h") continue;
      const c = q.cells[i], span = document.createElement("span");
      const width = Math.max(1, showText(c.text).length);
      span.className = "cell st-" + st;
      if (committed.has(i)) span.className += " now";
      if (st === "m" && f.planned[i]) { span.className += " planned"; span.textContent = showText(f.planned[i][1]); }
      else if (st === "m" || st === "x") span.textContent = "\u00B7".repeat(width);
      else span.textContent = showText(c.text);
      const slot = slotOf(q, f, i);
      span.dataset.slot = slot;
      if (slot !== lastSlot) span.classList.add("slot-start");
      lastSlot = slot;
      span.title = describeCell(q, f, i);
      span.addEventListener("mouseenter", () => {
        canvas.querySelectorAll('[data-slot="' + slot + '"]').forEach((e) => e.classList.add("hover"));
        $("info").textContent = span.title;
      });
      span.addEventListener("mouseleave", () => {
        canvas.querySelectorAll(".hover").forEach((e) => e.classList.remove("hover"));
      });
      canvas.appendChild(span);
      if (c.text.includes("\n") && st !== "m" && st !== "x") canvas.appendChild(document.createElement("br"));
    }
    const st = q.stats;
    $("stats").textContent = frameIndex === n - 1 ? ["tokens " + st.tokens, "rounds " + n, "forwards " + st.forwards,
      "tokens/forward " + fmt(st.tokens_per_forward), ...q.summary, (st.seconds || 0).toFixed(2) + " s",
      q.finish_reason].join(" \u00B7 ") : "";
    document.querySelectorAll("#rounds tbody tr").forEach((tr, j) => tr.classList.toggle("current", j === frameIndex));
  }

  function buildRounds() {
    const body = document.querySelector("#rounds tbody"); body.textContent = "";
    seq().frames.forEach((f, j) => {
      const tr = document.createElement("tr");
      const a = document.createElement("td"), b = document.createElement("td");
      a.textContent = j + 1; b.textContent = f.line;
      tr.append(a, b); tr.addEventListener("click", () => { frameIndex = j; render(); });
      body.appendChild(tr);
    });
  }

  function go(i) { stop(); frameIndex = i; render(); }
  function stop() { if (timer) { clearInterval(timer); timer = null; $("play").innerHTML = "&#x25B6;"; } }
  function play() {
    if (timer) return stop();
    if (frameIndex >= seq().frames.length - 1) frameIndex = -1;
    $("play").innerHTML = "&#x23F8;";
    timer = setInterval(() => {
      if (frameIndex >= seq().frames.length - 1) return stop();
      frameIndex++; render();
    }, 600);
  }
  $("first").onclick = () => go(0);
  $("last").onclick = () => go(seq().frames.length - 1);
  $("prev").onclick = () => go(frameIndex - 1);
  $("next").onclick = () => go(frameIndex + 1);
  $("play").onclick = play;
  $("slider").oninput = (e) => go(Number(e.target.value));
  $("seq").onchange = (e) => { stop(); seqIndex = Number(e.target.value); frameIndex = 0; buildRounds(); render(); };
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "SELECT") return;
    if (e.key === "ArrowLeft") go(frameIndex - 1);
    else if (e.key === "ArrowRight") go(frameIndex + 1);
    else if (e.key === "Home") go(0);
    else if (e.key === "End") go(seq().frames.length - 1);
    else if (e.key === " ") { e.preventDefault(); play(); }
  });
  buildRounds(); render();
})();
"""
