"""`python -m d3d.cli`: the `d3d` command."""

import sys

from d3d.cli import main

sys.exit(main())
