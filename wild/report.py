"""results/wild.md from the wild runs: the table, each clean finding classified, the injected bugs, the true
findings' documentation, and what cannot run."""

from __future__ import annotations

import statistics
from pathlib import Path

from faultbench.harness import atomic
from wild.programs import CANNOT_RUN, PROGRAMS
from wild.verdicts import BY_DESIGN, FALSE, TRUE, TRUE_FINDINGS, classify


def _findings(result: dict) -> list[dict]:
    return [f for w in result.get("watches", []) for f in w["findings"]]


def _acknowledged(result: dict) -> list[dict]:
    return [f for w in result.get("watches", []) for f in w["acknowledged"]]


def _errors(result: dict) -> list[str]:
    errs = [f"{d}: {e}" for w in result.get("watches", []) for d, e in w["errors"].items()]
    if result.get("error"):
        errs.append(f"program: {result['error']}")
    if not result.get("watches") and not result.get("error"):
        errs.append("no watch was attached")
    return errs


def _place(f: dict) -> str:
    code = (f.get("evidence") or {}).get("code") or {}
    where = f.get("where") or "?"
    if code.get("qualname"):
        lib = f" ({code['library']})" if code.get("library") else ""
        return f"{where} @ {code['qualname']}{lib}"
    return where


def _line(f: dict) -> str:
    msg = " ".join(f["message"].split())
    if len(msg) > 260:
        msg = msg[:257] + "..."
    return f"`{f['detector']}` [{f['subsystem']}] {_place(f)}, step {f['step']}: {msg}"


def _bug_row(bug, result: dict, control: set) -> dict:
    found = [f for f in _findings(result) if (f["detector"], f.get("where")) not in control]
    crashed = bool(result.get("error"))
    top = found[0] if found else None
    right = top is not None and top["subsystem"] in bug.subsystems
    text = " ".join([(top or {}).get("where") or "", _place(top) if top else ""]).lower()
    named = top is not None and any(p.lower() in text for p in bug.places)
    first_right = next((f for f in found if f["subsystem"] in bug.subsystems), None)
    return {"detected": bool(found), "right": right, "named": named, "crashed": crashed,
            "latency": None if first_right is None else first_right["step"], "top": top, "errors": _errors(result)}


def write_report(results: dict, seeds: list[int], out) -> int:
    """Writes the report; returns the number of false or unclassified findings on clean runs."""
    lines = ["# In the wild: the watch on unmodified training programs", "",
             "Written by `make wild` (`python -m wild`, wild/). Each program runs unmodified at a tiny offline "
             "configuration with faultbench attached the documented way, on seeds "
             f"{', '.join(map(str, seeds))} clean; then seed {seeds[0]} clean again with a golden recorded from the "
             f"clean runs of seeds {', '.join(map(str, seeds[1:]))} (what a user's golden is), each injected bug "
             f"(wild/bugs/) on seed {seeds[0]} with that golden, and seed {seeds[0]} without the watch (the overhead's "
             "baseline: the loop's wall time from the optimizer's construction to the program's end, watched / not "
             "watched, one run each on a shared 2-core machine: a rough figure).", ""]
    table = ["| program | upstream | attached by | clean runs | clean findings (true / false / by design / "
             "unclassified) | detector errors | bugs detected | right place first | names the edited code | "
             "median latency (steps) | overhead |", "|" + "---|" * 11]
    body, bug_lines, falses = [], [], 0
    totals = {"runs": 0, TRUE: 0, FALSE: 0, BY_DESIGN: 0, None: 0, "bugs": 0, "detected": 0, "right": 0, "named": 0}
    seen_true = set()
    for name, runs in results.items():
        program = PROGRAMS[name]
        body += [f"## {name}: {program.title}", "", f"Upstream: {program.upstream}. Attached by: {program.attach}."
                 + (f" {program.notes}." if program.notes else ""), ""]
        counts = {TRUE: 0, FALSE: 0, BY_DESIGN: 0, None: 0}
        errors = 0
        clean = [(f"seed {s}", r) for s, r in runs["clean"].items()]
        if runs["golden_clean"] is not None:
            clean.append((f"seed {seeds[0]} + golden", runs["golden_clean"]))
        ok_runs = 0
        for label, result in clean:
            findings, errs = _findings(result), _errors(result)
            ok_runs += not result.get("error")
            steps = max((w["steps"] for w in result.get("watches", [])), default=0)
            acked = _acknowledged(result)
            head = f"- **{label}** ({steps} optimizer steps): "
            if not findings:
                head += "no findings"
            body.append(head + (f"; {len(acked)} acknowledged by the golden (library code)" if acked else ""))
            for f in findings:
                v = classify(name, f)
                kind = v.kind if v else None
                counts[kind] += 1
                if v and v.kind == TRUE:
                    seen_true.add(v.key)
                tag = f"**{kind}** ([{v.key}](#{v.key}))" if v else "**UNCLASSIFIED**"
                body.append(f"  - {tag}: {_line(f)}")
            for e in errs:
                errors += 1
                body.append(f"  - error: {e}")
        body.append("")
        falses += counts[FALSE] + counts[None]
        totals["runs"] += len(clean)
        for k in (TRUE, FALSE, BY_DESIGN, None):
            totals[k] += counts[k]
        control = {(f["detector"], f.get("where")) for f in _findings(runs["golden_clean"] or {})}
        rows = [(bug, _bug_row(bug, result, control)) for bug, result in runs["bugs"].values()]
        for bug, row in rows:
            top = row["top"]
            bug_lines.append(
                f"| {name} | [{bug.name}](bugs/{name}/{bug.name}.patch) {bug.title} | {'/'.join(bug.subsystems)} | "
                f"{'yes' if row['detected'] else '**no**'} | {'yes' if row['right'] else 'no'} | "
                f"{'yes' if row['named'] else 'no'} | {'-' if row['latency'] is None else row['latency']} | "
                f"{(_line(top).replace('|', '/')[:300]) if top else ', '.join(row['errors'])[:200] or '-'} |")
        detected = sum(r["detected"] for _, r in rows)
        right = sum(r["right"] for _, r in rows)
        named = sum(r["named"] for _, r in rows)
        lat = [r["latency"] for _, r in rows if r["latency"] is not None]
        totals["bugs"] += len(rows)
        totals["detected"] += detected
        totals["right"] += right
        totals["named"] += named
        watched = (runs["clean"].get(seeds[0]) or {}).get("loop_s")
        base = (runs["baseline"] or {}).get("loop_s")
        overhead = f"{watched / base:.2f}x ({watched:.1f} s / {base:.1f} s)" if watched and base else "-"
        table.append(f"| {name} | {program.upstream} | {program.attach} | {ok_runs}/{len(clean)} | "
                     f"{counts[TRUE]} / {counts[FALSE]} / {counts[BY_DESIGN]} / {counts[None]} | {errors} | "
                     f"{detected}/{len(rows)} | {right}/{len(rows)} | {named}/{len(rows)} | "
                     f"{statistics.median(lat) if lat else '-'} | {overhead} |")
    bugs = max(totals["bugs"], 1)
    lines += table + ["", f"Clean runs: {totals['runs']}; findings on them: {totals[TRUE]} true, "
                      f"{totals[FALSE]} false, {totals[BY_DESIGN]} by design, {totals[None]} unclassified. "
                      f"Injected bugs: {totals['bugs']}, "
                      f"detected {totals['detected']} ({totals['detected'] / bugs:.0%}), right subsystem first "
                      f"{totals['right']} ({totals['right'] / bugs:.0%}), the first finding names the edited code "
                      f"{totals['named']} ({totals['named'] / bugs:.0%}).", "",
                      "# Clean runs, per program and seed", ""]
    lines += body
    lines += ["# Injected bugs", "",
              f"Each is a patch of the program's own code (wild/bugs/<program>/), run on seed {seeds[0]} with the "
              "golden of the clean seeds. *Detected*: a finding the clean run with the same golden did not make. "
              "*Right place first*: the first finding's subsystem is one the patch's header accepts. *Names the "
              "edited code*: the first finding's place (module path or code location) names the edited function, "
              "module or object. *Latency*: the step of the first finding in a right subsystem (every bug acts from "
              "step 0).", "",
              "| program | bug | accepted | detected | right place first | names the edited code | latency | "
              "first finding |", "|" + "---|" * 8] + bug_lines + [""]
    lines += ["# True findings", ""]
    for key, doc in TRUE_FINDINGS.items():
        status = "seen in this run" if key in seen_true else "not seen in this run"
        lines += [f'<a id="{key}"></a>', f"## {doc['title']} ({status})", "", f"- Upstream: {doc['upstream']}",
                  f"- Reproduction: {doc['reproduction']}", "- Issue text (not filed):", ""]
        lines += ["> " + para if para else ">" for para in doc["issue"].split("\n")]
        lines.append("")
    lines += ["# Programs that cannot run here", ""]
    lines += [f"- **{k}**: {v}" for k, v in CANNOT_RUN.items()]
    lines.append("")
    atomic.write_text(Path(out), "\n".join(lines))
    return falses
