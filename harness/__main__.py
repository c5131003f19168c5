from faultbench.harness.cli import main

raise SystemExit(main())
