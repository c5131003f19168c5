"""The wild harness end to end on its smallest program (issue 27): nanoGPT's train.py and model.py, vendored
unmodified, run at a tiny offline config through the one-line wrapper (``python -m wild.attach``), clean and with
one injected bug (wild/bugs/nanogpt/not_causal.patch). The other programs run under ``make wild`` only."""

from __future__ import annotations

from wild.programs import PROGRAMS
from wild.run import bugs_of, run_case


def test_clean_nanogpt_is_silent_and_a_missing_causal_mask_is_found_in_the_attention(tmp_path):
    program = PROGRAMS["nanogpt"]
    clean = run_case(program, 0, "clean", work=tmp_path)
    assert clean["error"] is None, clean.get("traceback")
    [watch] = clean["watches"]
    assert watch["steps"] == 21 and watch["errors"] == {}
    assert watch["findings"] == [], watch["report"]

    bug = next(b for b in bugs_of("nanogpt") if b.name == "not_causal")
    broken = run_case(program, 0, "not_causal", bug=bug, work=tmp_path)
    assert "is_causal=False" in (tmp_path / "nanogpt" / "not_causal" / "model.py").read_text()
    [watch] = broken["watches"]
    top = watch["findings"][0]
    assert top["subsystem"] in bug.subsystems, watch["report"]
    assert top["where"].startswith("transformer.h.0.attn"), watch["report"]
