"""Plugin: every candidate mutant of every target registered as a fault (admission's rank workers load it).

Candidates registered here have no home recipe yet (a plain manifest): the admission registers the ones it
runs with theirs first, in its own process, and this module only adds the rest.
"""

from faultbench import targets
from faultbench.faults.mutants.generate import candidates, register

for _target in targets.names():
    register([(c, {"manifest": {}}) for c in candidates(_target)])
