"""`python -m rla_compile ...` is `rla-compile ...`."""

import sys

from .cli import main

sys.exit(main())
