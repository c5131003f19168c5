"""Plugin: the admitted mutant set (``mutants-v1.json``) registered as faults, for ``bench --mutants``.

A mutant whose seam changed since admission (its generated function no longer matches the recorded digest)
is stale: it is not registered, and ``STALE`` lists it (``faultbench mutate`` re-admits).
"""

import hashlib
import json

from faultbench.faults.mutants import admitted_path
from faultbench.faults.mutants.generate import by_id, register

STALE: list[str] = []


def _entries():
    doc = json.loads(admitted_path().read_text())
    for m in doc["mutants"]:
        c = by_id(m["target"]).get(m["id"])
        if c is None or hashlib.sha256(c.function.encode()).hexdigest()[:16] != m["digest"]:
            STALE.append(m["id"])
            continue
        yield c, {"manifest": m["manifest"], "trigger": m["trigger"], "symptoms": tuple(m["symptoms"])}


register(list(_entries()))
