"""``python -m tq_chunked.vendor``."""

import sys

from .cli import main

sys.exit(main())
