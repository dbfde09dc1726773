"""The ``swe-flush`` command line: ``main`` and its command table (``main``), what the commands share
(``command``), ``demo`` and ``stub`` (``demo``, loaded only for them) and ``doctor``."""

from .main import main as main
