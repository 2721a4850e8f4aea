"""``python -m xpress_jax.convert`` = ``xpress-convert``."""

import sys

from .cli import main

sys.exit(main())
