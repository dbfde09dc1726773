"""The command line (swe_flush_sync/_cli/): ``swe-flush``, ``doctor`` and what an operator sees."""
