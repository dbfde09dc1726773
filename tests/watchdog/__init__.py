"""The watchdog (swe_flush_sync/_watchdog/ and its process) with trainers that really die."""
