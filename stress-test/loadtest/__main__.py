"""`python -m loadtest ...`: the same CLI as the `loadtest` script."""

import sys

from loadtest.cli import main

sys.exit(main())
