"""Both tracks in one bench case: the black-box suite watches the same run as the white-box suite, through
faultbench.watch only, and each track is scored apart (harness/watched.py, harness/score.py)."""

import pytest

from faultbench.detectors.api import black_box_suite_ids, suite_ids
from faultbench.harness.case import execute
from faultbench.harness.record import Case
from faultbench.harness.score import BLACKBOX, SUITE, case_rows, seam_of


@pytest.fixture(scope="module")
def clean_runs():
    """The clean fp32 case with the white-box suite alone and with both tracks."""
    both = tuple(suite_ids() + black_box_suite_ids())  # not "all": a peer plugin loaded by another test registers too
    return {ids: execute(Case("fp32", 0, (), ids)) for ids in (tuple(suite_ids()), both)}


def test_watching_the_run_changes_nothing_of_it_and_finds_nothing_on_a_clean_run(clean_runs):
    alone, both = clean_runs.values()
    assert both["findings"] == [] and both["detector_errors"] == {}
    assert [h["loss"] for h in both["history"]] == [h["loss"] for h in alone["history"]]  # bit for bit
    assert both["val_loss"] == alone["val_loss"] and both["outputs"]["decoded"] == alone["outputs"]["decoded"]
    assert both["step_seconds"]["watch"] > 0  # the watch's own hook time is accounted (the track's overhead)


def test_a_causal_leak_is_found_by_both_tracks_and_each_is_scored_apart():
    ids = tuple(suite_ids() + black_box_suite_ids())
    record = execute(Case("fp32", 0, ("no_causal_mask",), ids))
    black = [f for f in record["findings"] if f["detector"] in black_box_suite_ids()]
    assert black and black[0]["subsystem"] == "mask" and black[0]["seam"] is None
    assert black[0]["where"] == "blocks.0.attn"  # the module path, in the user's terms
    assert black[0]["where_class"].endswith("model.attention.CausalSelfAttention")
    record["name"] = "no_causal_mask/fp32/s0"
    fault = {"subsystem": "mask", "also_acceptable": [], "seams": ["model.attention.build_attention_mask"],
             "trigger": "always"}
    rows = {r["detector"]: r for r in case_rows(record, {"no_causal_mask": fault}, suite_ids(), black_box_suite_ids())}
    assert rows[SUITE]["top1_subsystem"] and rows[BLACKBOX]["top1_subsystem"]
    assert rows[BLACKBOX]["top_detector"] in black_box_suite_ids()
    assert rows[BLACKBOX]["step_s"] >= record["step_seconds"]["watch"]


def test_the_scorer_maps_a_module_path_to_its_class_forward_only_where_the_target_has_that_seam():
    seams = {"model.attention.CausalSelfAttention.forward": "model"}
    where = {"seam": None, "where": "blocks.0.attn"}
    assert seam_of({**where, "where_class": "faultbench.model.attention.CausalSelfAttention"}, seams) == \
        "model.attention.CausalSelfAttention.forward"
    assert seam_of({**where, "where_class": "model.attention.CausalSelfAttention"}, seams) == \
        "model.attention.CausalSelfAttention.forward"
    assert seam_of({**where, "where_class": "torch.nn.modules.linear.Linear"}, seams) is None
    assert seam_of({"seam": "model.rope.apply_rope", "where_class": None}, seams) == "model.rope.apply_rope"
    assert seam_of({"seam": None, "where": "optimizer", "where_class": None}, seams) is None
    # a framework function's qualified name as the place (a crash's component), or a crash's code place
    hf = {"transformers.trainer.Trainer.create_optimizer": "optimizer"}
    assert seam_of({"seam": None, "where": "transformers.trainer.Trainer.create_optimizer"}, hf) == \
        "transformers.trainer.Trainer.create_optimizer"
    code = {"qualname": "transformers.trainer.Trainer.create_optimizer"}
    assert seam_of({"seam": None, "where": "optimizer", "evidence": {"code": code}}, hf) == \
        "transformers.trainer.Trainer.create_optimizer"
    assert seam_of({"seam": None, "where": "optimizer", "evidence": {"code": None}}, hf) is None
    closure = {"qualname": "faultbench.model.optim.make_scheduler.<locals>.<lambda>"}  # a schedule's lambda: its def
    assert seam_of({"seam": None, "where": "scheduler", "evidence": {"code": closure}},
                   {"model.optim.make_scheduler": "optimizer"}) == "model.optim.make_scheduler"


def test_golden_runs_record_what_a_watch_saw_and_hand_it_to_the_black_box_track_as_an_envelope():
    from faultbench.harness.golden import golden_cases, trace_of
    from faultbench.harness.watched import WATCH_HISTORY, envelope

    case = golden_cases(["fp32"])[0]
    trace = trace_of(execute(case))
    history = trace[WATCH_HISTORY]
    assert len(history) == len(trace["loss"]) and [h["step"] for h in history] == list(range(1, len(history) + 1))
    assert [h["lrs"][0] for h in history] == pytest.approx(trace["lr"])  # the lr the optimizer really used
    golden = envelope({"runs": [trace, trace]})
    assert golden["runs"] == 2 and len(golden["steps"]) == len(history)
    assert envelope({"runs": [{"loss": []}]}) is None and envelope(None) is None


SETUP_CRASH = '''
from faultbench.faults.registry import Manifest, fault


@fault(
    "plugin_corpus_config_crash",
    seam="model.data.load_corpus",
    title="A plugin fault: loading the corpus raises before any model exists",
    subsystem="data",
    trigger="always",
    symptoms=("crash-state",),
    explanation="load_corpus reads a field the config does not have.",
    fix="Read the config's own fields.",
    references=("Karpathy, A Recipe for Training Neural Networks: become one with the data",),
    manifest=Manifest(check="crash", steps=4, params={"types": ("AttributeError",)}),
)
def load_corpus(cfg):
    """The corpus of ``cfg``."""
    return cfg.documents
'''


def test_a_crash_before_the_loop_is_watched_is_located_by_the_guard_and_its_code_place_scored_as_a_seam(tmp_path):
    plugin = tmp_path / "setup_crash.py"
    plugin.write_text(SETUP_CRASH)
    ids = tuple(suite_ids() + black_box_suite_ids())
    record = execute(Case("fp32", 0, ("plugin_corpus_config_crash",), ids, plugins=(str(plugin),)))
    assert record["crash"]["type"] == "AttributeError"
    black = [f for f in record["findings"] if f["detector"] in black_box_suite_ids()]
    assert [(f["detector"], f["subsystem"]) for f in black] == [("bb_crash_site", "data")]
    assert black[0]["evidence"]["code"]["qualname"] == "faultbench.model.data.load_corpus"
    assert seam_of({**black[0], "seam": None}, {"model.data.load_corpus": "data"}) == "model.data.load_corpus"
