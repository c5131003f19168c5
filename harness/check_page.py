"""Open results/index.html in a real headless Chromium: the tables render and sort, and a screenshot is taken.

    python -m faultbench.harness.check_page [results/index.html] [--screenshot PATH]   (make check-page)

The page is copied to a temporary folder with a driver script appended (the page itself carries no test code):
the driver clicks a numeric header of every sortable table twice, reads the column back after each click, and
writes what it saw into the DOM, which Chromium dumps. Exit 0 when every table has rows and sorts both ways,
1 when something does not, 2 when Chromium or the page is missing.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Chromium as root, headless, offline: without the background-networking flags it keeps dialling Google's hosts.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")

DRIVER = """<script>
(() => {
  const num = t => { const n = parseFloat(t); return isNaN(n) ? null : n; };
  const out = [];
  document.querySelectorAll('table.sortable').forEach((table, i) => {
    const rows = table.tBodies[0].rows, heads = [...table.tHead.rows[0].cells];
    const col = heads.findIndex((h, c) => rows.length && [...rows].every(r => num(r.cells[c].textContent) !== null));
    const read = () => [...rows].map(r => num(r.cells[col].textContent));
    const entry = {table: table.id || String(i), rows: rows.length, column: col < 0 ? null : heads[col].textContent};
    if (col >= 0) {
      heads[col].click(); const up = read();
      heads[col].click(); const down = read();
      entry.ascending = up.every((v, k) => k === 0 || up[k - 1] <= v);
      entry.descending = down.every((v, k) => k === 0 || down[k - 1] >= v);
      entry.marked = heads[col].getAttribute('aria-sort');
    }
    out.push(entry);
  });
  const pre = document.createElement('pre'); pre.id = 'page-check'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def external_references(text: str) -> list[str]:
    """Every src/href that would leave the machine (the page must open offline)."""
    return re.findall(r'(?:src|href)="((?:https?:)?//[^"]*)"', text)


def sort_report(page: Path, browser: str) -> list[dict]:
    """What the driver saw in ``page``, per sortable table."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "index.html"
        copy.write_text(page.read_text().replace("</body>", DRIVER + "</body>"))
        dom = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp}/profile", "--dump-dom", copy.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<pre id="page-check">(.*?)</pre>', dom, re.S)
    if not found:
        raise RuntimeError("the driver left no report: the page's script did not run")
    return json.loads(html.unescape(found.group(1)))


def screenshot(page: Path, browser: str, dest: Path, size: str = "1280,1600") -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp}/profile", f"--window-size={size}",
                        f"--screenshot={dest.resolve()}", page.resolve().as_uri()],
                       capture_output=True, timeout=120, check=True)
    return dest


def problems(report: list[dict]) -> list[str]:
    out = [f"table {t['table']}: no rows" for t in report if not t["rows"]]
    out += [f"table {t['table']}: does not sort ({t})" for t in report
            if t["column"] is not None and not (t["ascending"] and t["descending"] and t["marked"] == "descending")]
    return out + ([] if report else ["no sortable table"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", nargs="?", default="results/index.html", type=Path)
    parser.add_argument("--screenshot", default=Path(".cache/page.png"), type=Path)
    args = parser.parse_args(argv)
    browser = chromium()
    missing = ("no Chromium on PATH (Debian: apt-get install chromium)" if browser is None else
               f"{args.page} not found: run make bench" if not args.page.is_file() else "")
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    report = sort_report(args.page, browser)
    found = problems(report) + [f"leaves the machine: {u}" for u in external_references(args.page.read_text())]
    shot = screenshot(args.page, browser, args.screenshot)
    print(f"{len(report)} sortable tables, {sum(t['rows'] for t in report)} rows; screenshot {shot}")
    for p in found:
        print(f"problem: {p}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
