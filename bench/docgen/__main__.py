"""``python -m bench.docgen``: rewrite every generated block."""

import sys

from bench.docgen.blocks import main

sys.exit(main())
