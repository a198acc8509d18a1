"""`python3 -m tutti ...`: the same as the `tutti` command."""

import sys

from tutti.tools.cli import main

sys.exit(main())
