"""``python -m slotserve.cli``: the same as the ``slotserve`` command."""

import sys

from slotserve.cli import main

sys.exit(main())
