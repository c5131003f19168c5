"""A watch's result as JUnit XML, the format CI systems gate on and display.

One ``<testsuite name="faultbench.watch">``; one ``<testcase>`` per detector: a ``<failure>`` per finding it made
(its message, subsystem, place and step), ``<skipped>`` when its assumption did not hold for the loop (the reason),
``<error>`` when it raised. A run with findings therefore fails the CI job that reads the file; acknowledged
findings (library code the golden's known-good runs made too) are not failures. Standard library only.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET


def junit_xml(detector_ids: list[str], report: dict) -> str:
    """The XML of a watch's ``to_dict()`` ``report`` over ``detector_ids`` (every detector it ran)."""
    findings: dict[str, list[dict]] = {}
    for finding in report["findings"]:
        findings.setdefault(finding["detector"], []).append(finding)
    suite = ET.Element("testsuite", name="faultbench.watch", tests=str(len(detector_ids)),
                       failures=str(sum(1 for d in detector_ids if d in findings)),
                       errors=str(sum(1 for d in detector_ids if d in report["errors"])),
                       skipped=str(sum(1 for d in detector_ids if d in report["not_applicable"])))
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="optimizer_steps", value=str(report["steps"]))
    for detector in detector_ids:
        case = ET.SubElement(suite, "testcase", classname="faultbench.watch", name=detector)
        if detector in report["errors"]:
            ET.SubElement(case, "error", message=str(report["errors"][detector])[:500])
        elif detector in report["not_applicable"]:
            ET.SubElement(case, "skipped", message=str(report["not_applicable"][detector])[:500])
        for f in findings.get(detector, []):
            where = f" {f['where']}" if f.get("where") else ""
            failure = ET.SubElement(case, "failure", type=f["subsystem"], message=f["message"][:500])
            failure.text = f"[{f['subsystem']}]{where} at step {f['step']}: {f['message']}"
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
