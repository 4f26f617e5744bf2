"""`python -m speculant.cli`: the command line."""

import sys

from speculant.cli import main

sys.exit(main())
