"""`python -m labkit`: the same as the `labkit` command (see labkit.cli)."""

from labkit.cli import main

raise SystemExit(main())
