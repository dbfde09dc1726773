"""The hooks (swe_flush_sync/_hooks.py): signals, exit, Ctrl-C, threads and forks in real processes."""
