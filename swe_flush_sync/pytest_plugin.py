"""The pytest plugin's fixtures under the package (for ``pytest_plugins = ["swe_flush_sync.pytest_plugin"]``).

pytest loads the plugin itself from the top-level ``swe_flush_sync_pytest`` (the ``pytest11`` entry
point ``swe_flush_sync``), which imports nothing of the package until a test asks for a fixture.
"""

from swe_flush_sync_pytest import agent_server, agent_server_tls

__all__ = ["agent_server", "agent_server_tls"]
