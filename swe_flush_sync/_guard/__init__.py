"""``swe-flush guard``: the daemon (``daemon``), its socket path (``socket_path``), dead trainers'
flushes (``flushes``) on a fair pool (``pool``), its parser process (``parser``) and metrics.

Imports nothing here: the parser process imports ``parser`` alone.
"""
