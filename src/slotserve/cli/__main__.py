"""``python -m slotserve.cli``: the same as the ``slotserve`` command."""

from slotserve.cli import run

run()
