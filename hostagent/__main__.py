"""`python -m hostagent` runs the CLI."""

from hostagent.cli import main

raise SystemExit(main())
