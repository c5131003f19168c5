"""results/index.html: the leaderboard as one static page, as benchmark leaderboards are published.

No server, no CDN: the styles, the script and the summary figure are inlined, the heatmaps are the PNG files beside
it. Sortable tables (click a header) of the headline per target and track, of the fault sets, and of each target
and track's detectors; a drill-down per fault (its diff, the real bug it models, each detector's top finding per
seed) and per detector (its scores and the faults it found). ``make check-page`` opens it in headless Chromium;
``faultbench page [DIR]`` redraws a folder's figures and page from its bench.csv.
"""

from __future__ import annotations

import base64
import html

from faultbench.harness.figures import (
    SCORES,
    TRACKS,
    headline,
    heatmap_name,
    heatmaps,
    scores,
    shown,
    summary_figure,
    track_detectors,
)

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;padding:0 16px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f3f3f3;cursor:pointer;user-select:none}th[aria-sort=ascending]::after{content:" \\25B2"}
th[aria-sort=descending]::after{content:" \\25BC"}
details{margin:4px 0;border:1px solid #eee;padding:4px 8px}summary{cursor:pointer}
pre{background:#f8f8f8;padding:8px;overflow-x:auto;font-size:12px}img{max-width:100%}
"""

# Click a header: sort its table's body by that column (numbers as numbers, "-" last), again to reverse.
SCRIPT = """
function sortTable(th){
  const table=th.closest('table'), body=table.tBodies[0], col=[...th.parentNode.children].indexOf(th);
  const dir=th.getAttribute('aria-sort')==='ascending'?'descending':'ascending';
  table.querySelectorAll('th').forEach(h=>h.removeAttribute('aria-sort'));
  th.setAttribute('aria-sort',dir);
  const key=tr=>{const t=tr.cells[col].textContent.trim(),n=parseFloat(t);return isNaN(n)?t:n;};
  const rows=[...body.rows].sort((a,b)=>{
    const x=key(a),y=key(b);
    if(x==='-'||y==='-')return (x==='-')-(y==='-');
    const c=typeof x===typeof y?(x<y?-1:x>y?1:0):(typeof x==='number'?-1:1);
    return dir==='ascending'?c:-c;});
  rows.forEach(r=>body.appendChild(r));
}
document.querySelectorAll('table.sortable th').forEach(th=>th.addEventListener('click',()=>sortTable(th)));
"""


def _cell(value) -> str:
    if value is None:
        return '<td class="n">-</td>'
    if isinstance(value, bool):
        return f"<td>{'yes' if value else 'no'}</td>"
    if isinstance(value, (int, float)):
        return f'<td class="n">{value:.3f}</td>' if isinstance(value, float) else f'<td class="n">{value}</td>'
    return f"<td>{value}</td>"  # already HTML (escaped text or a link)


def table(head: list[str], rows: list[list], table_id: str = "") -> str:
    """A sortable table; string cells are HTML (the caller escapes text), numbers are formatted."""
    ident = f' id="{table_id}"' if table_id else ""
    return (f'<table class="sortable"{ident}><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join("<tr>" + "".join(map(_cell, r)) + "</tr>" for r in rows)
            + "</tbody></table>")


def _anchor(kind: str, name: str) -> str:
    return f"{kind}-{''.join(c if c.isalnum() else '-' for c in name)}"


def _link(kind: str, name: str) -> str:
    return f'<a href="#{_anchor(kind, name)}">{html.escape(name)}</a>'


def _fault_diff(fault_id: str, meta: dict) -> str:
    """The fault's diff against the clean seam, where its registry (builtin or a loaded plugin) knows it."""
    from faultbench.faults.inject import diff
    from faultbench.faults.registry import FaultError

    if meta.get("diff"):
        return meta["diff"]
    try:
        return diff(fault_id)
    except (FaultError, OSError, TypeError) as e:  # a plugin not loaded here, or source not on disk
        return f"(no diff here: {e})"


SCORE_COLUMNS = ["shown fault cases", "detection", "top-1 subsystem", "top-1 seam", "FP"]  # ``SCORES``' headers


def _by(rows: list[dict], key: str) -> dict[str, list[dict]]:
    """The rows grouped by ``key`` (fault, detector), read once for the page's per-fault and per-detector parts."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def fault_details(fault_id: str, meta: dict, rows: list[dict]) -> str:
    """One fault's drill-down (``rows``: the fault's): what it is, the bug it models, its diff, and each detector's
    top finding per seed (the detectors that found something; the track suites first)."""
    mine = sorted((r for r in rows if r["detected"]),
                  key=lambda r: (r["detector"] not in dict(TRACKS).values(), r["detector"], str(r["seed"])))
    cases = {r["case"]: r.get("manifested") for r in rows}
    refs = "".join(f"<li>{html.escape(ref)}</li>" for ref in meta.get("references", ()))
    found = table(["detector", "recipe", "seed", "first step", "top subsystem", "top seam", "right subsystem first"],
                  [[html.escape(r["detector"]), html.escape(r["recipe"]), r["seed"], r.get("first_step"),
                    html.escape(r["top_subsystem"] or ""), html.escape(r["top_seam"] or ""), bool(r["top1_subsystem"])]
                   for r in mine]) if mine else "<p>No detector found it on any case.</p>"
    not_shown = sum(m is False for m in cases.values())
    return (f'<details id="{_anchor("fault", fault_id)}"><summary><b>{html.escape(fault_id)}</b> '
            f"[{html.escape(meta['subsystem'])}] {html.escape(meta.get('title', ''))}</summary>"
            f"<p>{html.escape(meta.get('explanation', ''))}</p><p><b>Fix:</b> {html.escape(meta.get('fix', ''))}</p>"
            f"<p><b>Models:</b></p><ul>{refs}</ul>"
            f"<p>{len(cases)} cases, {not_shown} where it did not show (not scored).</p>"
            f"<pre>{html.escape(_fault_diff(fault_id, meta))}</pre>{found}</details>")


def detector_details(detector: str, cls, rows: list[dict]) -> str:
    """One detector's drill-down (``rows``: the detector's): its scores per target and the faults it found (of its
    shown cases)."""
    per_target = [[target, *(s[k] for k in SCORES)] for target, mine in _by(rows, "target").items()
                  for s in [scores(mine)]]
    found = sorted({(r["target"], r["fault"]) for r in shown(rows) if r["detected"]})
    doc = html.escape((cls.__doc__ or "").strip().split("\n\n")[0]) if cls else ""
    return (f'<details id="{_anchor("detector", detector)}"><summary><b>{html.escape(detector)}</b> '
            f"({html.escape(getattr(cls, 'track', 'suite'))})</summary><p>{doc}</p>"
            + table(["target", *SCORE_COLUMNS], per_target)
            + "<p>Found: " + (", ".join(f"{t}/{_link('fault', f)}" for t, f in found) or "nothing") + "</p></details>")


def page(rows: list[dict], faults: dict[str, dict], registry, set_rows: list[dict], figure: bytes,
         images: list[str]) -> str:
    """The whole page (``figure``: the summary PNG, inlined; ``images``: heatmap files beside the page)."""
    head = table(["target", "track", *SCORE_COLUMNS], [[h["target"], h["track"], *(h[k] for k in SCORES)]
                                                       for h in headline(rows)], "headline")
    parts = ["<h1>faultbench leaderboard</h1>",
             "<p>Detection and localization of the injected faults, per target (<code>ref</code>: the reference "
             "GPT; <code>hf</code>: a tiny Llama under <code>Trainer</code>) and track (white-box seam probes; "
             "black-box: <code>faultbench.watch</code> and the HF callback). Means over the cases where the fault "
             "showed; FP over the clean matrix. Click a header to sort.</p>",
             "<h2>Headline</h2>", head,
             f'<img alt="summary figure" src="data:image/png;base64,{base64.b64encode(figure).decode()}">']
    if set_rows:
        parts += ["<h2>Fault sets</h2>",
                  table(["target", "track", "set", "faults", "seeds", "detection", "top-1 subsystem", "top-1 seam",
                         "FP"],
                        [[r["target"], r["track"], r["set"], r["faults"], r["seeds"], r["detection_rate"],
                          r["top1_subsystem"], r["top1_seam"], r["false_positive_rate"]] for r in set_rows], "sets")]
    for target, mine in _by(rows, "target").items():
        by_detector = _by(mine, "detector")
        for track, _ in TRACKS:
            detectors = track_detectors(mine, registry, track)
            if not detectors:
                continue
            body = [[_link("detector", d), *(s[k] for k in SCORES)]
                    for d in detectors for s in [scores(by_detector[d])]]
            parts += [f"<h2>Target {target}, {track}</h2>", table(["detector", *SCORE_COLUMNS], body)]
            image = heatmap_name(target, track)
            if image in images:
                parts.append(f'<p><a href="{image}">heatmap: detector x fault ({image})</a></p>')
        per_fault = []
        for f, fault_rows in sorted(_by(mine, "fault").items()):
            if f not in faults:
                continue
            cells = [_link("fault", f), html.escape(faults[f]["subsystem"])]
            for _, suite in TRACKS:
                s = scores([r for r in fault_rows if r["detector"] == suite])
                cells += [s["detected"], s["top1_subsystem"]]
            per_fault.append(cells)
        parts += [f"<h2>Target {target}: faults</h2>",
                  table(["fault", "subsystem", "white-box detection", "white-box top-1 subsystem",
                         "black-box detection", "black-box top-1 subsystem"], per_fault, f"faults-{target}")]
    by_fault = _by(rows, "fault")
    parts += ["<h2>Faults</h2>"] + [fault_details(f, faults[f], by_fault[f]) for f in sorted(by_fault) if f in faults]
    parts += ["<h2>Detectors</h2>"] + [detector_details(d, registry.get(d), group)
                                        for d, group in sorted(_by(rows, "detector").items())]
    preamble = ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>faultbench leaderboard</title>'
            f"<style>{STYLE}</style></head><body>\n")
    return preamble + "\n".join(parts) + f"\n<script>{SCRIPT}</script></body></html>\n"


def render(rows: list[dict], faults: dict[str, dict], registry, set_rows: list[dict]) -> dict[str, bytes]:
    """Every presentation file of a results folder: summary.png, the heatmaps and index.html, by file name."""
    figure = summary_figure(rows, faults, set_rows)
    files = {"summary.png": figure, **heatmaps(rows, faults, registry)}
    files["index.html"] = page(rows, faults, registry, set_rows, figure, list(files)).encode()
    return files
