"""slotserve."""
