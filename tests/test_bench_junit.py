"""``bench --junit FILE`` / ``merge --junit FILE``: the bench as JUnit XML for a CI gate, a testcase per goal of each
target's track suites and per detector's false positives, in the vocabulary pytest's own JUnit writer (what CI
systems read) uses."""

import subprocess
import sys
import xml.etree.ElementTree as ET

from faultbench.harness.report import junit_xml

SUMMARY = {
    "goals": {"suite": {"detection_rate": [">=", 0.95], "overhead_ratio": ["<=", 1.05]},
              "blackbox": {"false_positive_rate": ["<=", 0.0]}},
    "targets": {"ref": {
        "suite": {"detection_rate": 0.9, "fault_cases": 10},
        "blackbox": {"false_positive_rate": 0.0, "fault_cases": 10},
        "detectors": {"quiet": {"clean_cases": 4, "false_positive_rate": 0.0},
                      "noisy": {"clean_cases": 4, "false_positive_rate": 0.25},
                      "faults_only": {"clean_cases": 0, "false_positive_rate": None}}}},
}
TIMINGS = {"detectors": {"ref": {"suite": {"overhead_ratio": 1.01}}}}


def test_an_unmet_goal_and_a_false_positive_are_failures_and_a_detector_without_clean_cases_is_skipped():
    root = ET.fromstring(junit_xml(SUMMARY, TIMINGS))
    suite = root.find("testsuite")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["white-box suite.detection_rate >= 0.95"].find("failure").get("message") == "measured 0.900"
    assert cases["white-box suite.overhead_ratio <= 1.05"].find("failure") is None  # a timing, met
    assert cases["black-box blackbox.false_positive_rate <= 0.0"].find("failure") is None
    assert "0.250 of 4 clean cases" in cases["noisy"].find("failure").get("message")
    assert cases["quiet"].find("failure") is None and cases["faults_only"].find("skipped") is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("6", "2", "1")


# The attributes the common JUnit schema (Jenkins' junit-10.xsd, the one CI plugins validate) allows per element.
SCHEMA = {"testsuites": {"name", "time", "tests", "failures", "disabled", "errors"},
          "testsuite": {"name", "tests", "failures", "errors", "group", "time", "disabled", "skipped", "timestamp",
                        "hostname", "id", "package", "file", "log", "url", "version"},
          "testcase": {"name", "assertions", "time", "classname", "status", "group"},
          "failure": {"message", "type"}, "error": {"message", "type"}, "skipped": {"message"},
          "properties": set(), "property": {"name", "value"}}


def test_the_elements_are_pytests_and_the_attributes_the_schemas(tmp_path):
    """Every element is one pytest's JUnit writer (what CI systems read) also writes; every attribute one the
    schema allows on it."""
    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
                                        "@pytest.mark.skip(reason='r')\ndef test_skip():\n    pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:faultbench",
                    f"--junitxml={tmp_path / 'ref.xml'}", str(tmp_path / "test_x.py")],
                   capture_output=True, timeout=120)

    def vocabulary(root) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for element in root.iter():
            out.setdefault(element.tag, set()).update(element.attrib)
        return out

    theirs = vocabulary(ET.parse(tmp_path / "ref.xml").getroot())
    ours = vocabulary(ET.fromstring(junit_xml(SUMMARY, TIMINGS)))
    assert {"testsuites", "testsuite", "testcase", "failure", "skipped"} <= set(theirs)  # pytest wrote them
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    for tag, attributes in ours.items():
        assert attributes <= SCHEMA[tag], (tag, attributes - SCHEMA[tag])
