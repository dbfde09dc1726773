"""What the watchdog process and the guard share (swe_flush_sync/_process/): the wire and the ledger record."""
