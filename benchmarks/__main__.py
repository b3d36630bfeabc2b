"""``python -m benchmarks <name> [options]``: see :mod:`benchmarks.cli`."""

from benchmarks.cli import main

raise SystemExit(main())
