"""The package version, in one place (read by setup.cfg and sent as the User-Agent)."""

__version__ = "1.2.0"
