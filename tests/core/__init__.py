"""The flush core (swe_flush_sync/_core/): the transport, the deadline, single flight, fairness, until_idle."""
