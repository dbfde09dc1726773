"""The flush core: one blocking call that flushes every (server, id) pair in parallel within a
deadline, and reports each one. Everything above it calls ``Flusher``; it imports nothing above.

Imports nothing here: the watchdog process imports the standard-library-only modules of this
package (``errors``, ``resolve``, ``auth``, ``text``) while it waits, and no more.
"""
