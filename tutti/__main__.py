"""`python3 -m tutti ...`: the same as the `tutti` command."""

import sys

from tutti.cli import main

sys.exit(main())
