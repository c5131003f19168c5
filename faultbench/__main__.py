"""``python -m faultbench``: the command line (``faultbench.harness.cli``)."""

from faultbench.harness.cli import main

raise SystemExit(main())
