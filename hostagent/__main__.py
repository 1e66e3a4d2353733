"""`python -m hostagent` runs the CLI."""

from hostagent.cli.parser import main

raise SystemExit(main())
