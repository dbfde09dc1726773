"""What the watchdog process and the guard share, standard library only: the line protocol, /proc,
the trust checks, lock files, ledger records, the watch loop, and the watchdog process's ``main``.

Imports nothing here: the watchdog process runs this package as a fresh interpreter's script
(``watchdog_process``) and must not import ``requests`` until its trainer is gone.
"""
