"""`python -m ddptrain` is the `ddptrain` command."""

from ddptrain.cli import main

raise SystemExit(main())
