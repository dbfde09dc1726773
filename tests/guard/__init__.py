"""``swe-flush guard`` (swe_flush_sync/_guard/): a daemon with real peers, deaths and faults."""
