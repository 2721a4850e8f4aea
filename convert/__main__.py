"""``python -m convert`` = ``xpress-convert``."""

import sys

from .cli import main

sys.exit(main())
