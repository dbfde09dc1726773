"""The trainer's side of a watchdog: ``watchdog()`` and its handle (``api``), the line it writes
(``link``), the end it writes to (``ends``: a local process or a guard) and the check of who
listens at a guard's socket (``guard_client``)."""
