"""``python -m kvroute``: the same command line as ``kvroute``."""

from kvroute.cli import main

raise SystemExit(main())
