"""The bench's presentation: the summary figure, the heatmaps per target and track, and the static page.

Bench rows are made here (the scorer's keys, two real faults of the reference); the page is parsed as HTML, and
where Chromium is installed it is opened in it (``harness.check_page``): every table renders and sorts both ways.
"""

import struct
from html.parser import HTMLParser

import pytest

from faultbench.detectors.api import all_detectors
from faultbench.faults.registry import all_faults
from faultbench.harness import check_page, figures
from faultbench.harness.page import SCRIPT, render
from faultbench.harness.score import BLACKBOX, SUITE

WHITE, BLACK = "forward_loss_contract", "bb_causality"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _row(fault, seed, detector, found=False, right=False, manifested=True):
    return {"case": f"{fault or 'clean'}/fp32/s{seed}", "target": "ref", "fault": fault, "recipe": "fp32",
            "seed": seed, "detector": detector, "detected": found, "top1_subsystem": right, "top1_seam": right,
            "manifested": manifested if fault else None, "first_step": 0 if found else None,
            "top_subsystem": "loss" if found else "", "top_seam": "model.train.forward_loss" if found else ""}


@pytest.fixture(scope="module")
def bench():
    """label_permute found by the white-box track (right subsystem) and missed by the black-box one; no_causal_mask
    found by both, the black-box track naming another subsystem; seed 1 of no_causal_mask did not show; clean rows
    silent but one black-box false positive."""
    faults = {f: m.metadata() for f, m in all_faults("ref").items() if f in ("label_permute", "no_causal_mask")}
    rows = []
    for seed in (0, 1):
        rows += [_row("label_permute", seed, d, found=d in (SUITE, WHITE), right=d in (SUITE, WHITE))
                 for d in (SUITE, WHITE, BLACKBOX, BLACK)]
        rows += [_row("no_causal_mask", seed, d, found=True, right=d in (SUITE, WHITE), manifested=seed == 0)
                 for d in (SUITE, WHITE, BLACKBOX, BLACK)]
        rows += [_row("", seed, d, found=seed == 1 and d in (BLACKBOX, BLACK)) for d in (SUITE, WHITE, BLACKBOX, BLACK)]
    set_rows = [{"set": s, "target": "ref", "track": t, "faults": 2, "seeds": 2, "detection_rate": v,
                 "top1_subsystem": v, "top1_seam": 0.0, "false_positive_rate": 0.0}
                for s, v in (("registry", 0.9), ("blind", 0.6), ("blind2", 0.4), ("mutants", 0.7))
                for t in ("white-box", "black-box")]
    return rows, faults, set_rows, render(rows, faults, all_detectors(), set_rows)


def test_the_headline_counts_shown_cases_per_track(bench):
    rows, *_ = bench
    head = {h["track"]: h for h in figures.headline(rows)}
    assert head["white-box"]["cases"] == 3  # 2 + 1: no_causal_mask's seed 1 did not show
    assert head["white-box"]["detected"] == 1.0 and head["white-box"]["top1_subsystem"] == 1.0
    assert head["black-box"]["detected"] == pytest.approx(1 / 3) and head["black-box"]["top1_subsystem"] == 0.0
    assert head["black-box"]["fp"] == 0.5 and head["white-box"]["fp"] == 0.0


def test_figures_are_one_per_target_and_track_and_readable_sizes(bench):
    *_, files = bench
    assert {n for n in files if n.endswith(".png")} == {"summary.png", "heatmap_ref_white.png", "heatmap_ref_black.png"}
    assert _png_size(files["summary.png"]) == (1200, 800)
    for name in ("heatmap_ref_white.png", "heatmap_ref_black.png"):
        assert max(_png_size(files[name])) < 2000


def test_a_large_set_gets_one_heatmap_row_per_subsystem():
    subsystems = ("loss", "mask", "data")
    faults = {f"m{i}": {"subsystem": subsystems[i % 3]} for i in range(figures.MAX_FAULT_ROWS + 10)}
    rows = [_row(f, 0, SUITE, found=i % 2 == 0, right=i % 2 == 0) for i, f in enumerate(faults)]
    grid, labels = figures.heatmap_grid(rows, faults, [SUITE])
    assert labels == ["data (30 faults)", "loss (30 faults)", "mask (30 faults)"]
    assert grid[:, 0].tolist() == [0.5, 0.5, 0.5]  # every other fault found, with its subsystem first
    small, small_labels = figures.heatmap_grid(rows[:5], faults, [SUITE])
    assert [label.split()[0] for label in small_labels] == ["m2", "m0", "m3", "m1", "m4"]  # by subsystem, then id
    assert small[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self.details, self.images, self.text = 0, [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tables += tag == "table" and "sortable" in (attrs.get("class") or "")
        if tag == "details":
            self.details.append(attrs["id"])
        if tag == "img":
            self.images.append(attrs["src"])

    def handle_data(self, data):
        self.text.append(data)


def test_the_page_is_self_contained_with_a_drill_down_per_fault_and_detector(bench):
    *_, files = bench
    text = files["index.html"].decode()
    page = _Page()
    page.feed(text)
    body = "".join(page.text)
    assert check_page.external_references(text) == []
    assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
    assert {"fault-label-permute", "fault-no-causal-mask"} <= set(page.details)
    assert {f"detector-{d.replace('_', '-')}" for d in (SUITE, BLACKBOX, WHITE, BLACK)} <= set(page.details)
    assert "+++ b/model/train.py (model.train.forward_loss)" in body  # label_permute's diff, unescaped by the parser
    assert 'href="heatmap_ref_white.png"' in text
    assert page.tables >= 4  # headline, sets, a detector table per track, the faults of the target


@pytest.mark.skipif(check_page.chromium() is None, reason="no Chromium (Debian: apt-get install chromium)")
def test_every_table_sorts_both_ways_in_chromium_and_a_page_without_its_script_does_not(bench, tmp_path):
    *_, files = bench
    good = tmp_path / "index.html"
    good.write_bytes(files["index.html"])
    report = check_page.sort_report(good, check_page.chromium())
    assert check_page.problems(report) == [] and len(report) >= 4
    assert sum(t["rows"] for t in report if t["table"] == "headline") == 2
    broken = tmp_path / "broken.html"
    broken.write_text(files["index.html"].decode().replace(SCRIPT, ""))  # headers that do not sort
    assert any("does not sort" in p for p in check_page.problems(check_page.sort_report(broken, check_page.chromium())))
    shot = check_page.screenshot(good, check_page.chromium(), tmp_path / "page.png")
    assert _png_size(shot.read_bytes()) == (1280, 1600)


def test_the_page_command_redraws_a_folder_from_its_bench_csv(bench, tmp_path, capsys):
    from faultbench.harness.cli import main
    from faultbench.harness.report import csv_text

    rows, *_ = bench
    (tmp_path / "bench.csv").write_text(csv_text(rows))
    assert main(["page", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"bench.csv", "summary.png", "index.html", "heatmap_ref_white.png",
                                                    "heatmap_ref_black.png"}
    assert "fault-label-permute" in (tmp_path / "index.html").read_text()
    assert main(["page", str(tmp_path / "nothing")]) == 2
    assert "bench.csv not found" in capsys.readouterr().err
