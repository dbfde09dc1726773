"""``recover`` (swe_flush_sync/_recover.py): the ledger with real processes, and what it may believe."""
