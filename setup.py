"""Packaging shim: the metadata is in setup.cfg. Only the long description is built here: PyPI
shows README.md, but resolves no relative image or link, so images with a relative path are
left out and relative links keep their text (the repository's README keeps both)."""

import re
from pathlib import Path

from setuptools import setup


def pypi_description() -> str:
    """README.md for someone who ran ``pip install swe-flush-sync``: from "What it is for" on, without
    the repository's make targets, the install from a checkout, the chart and the relative links."""
    text = (Path(__file__).parent / "README.md").read_text(encoding="utf-8")
    body = text[text.index("## What it is for"):text.index("## Documentation")]
    body = re.sub(r"(?s)## Install\n.*?(?=\n## )", INSTALL, body)
    body = re.sub(r"(?m)^!\[[^\]]*\]\((?!https?://)[^)]*\)\n\n?", "", body)
    body = re.sub(r"\[([^\]]+)\]\((?!https?://|#)[^)]*\)", r"\1", body)
    body = body.replace("`make bench` reproduces it.", "The benchmarks ship in the source distribution.")
    return "# swe_flush_sync\n\n" + body + DOCUMENTATION


INSTALL = """## Install

```
pip install swe-flush-sync
```

Linux (it reads /proc and uses SO_PEERCRED and os.register_at_fork), Python 3.10 to 3.15;
runtime dependencies `requests>=2.30` and `urllib3>=2.0.2,<3`.
"""
DOCUMENTATION = """## Documentation

The documentation (getting started, the trainer guide, hard deaths, deployment recipes for
Kubernetes, Slurm and Ray, configuration, TLS, the command line, the API reference and the
changelog) ships in the source distribution's `docs/` folder, built with `make docs`.
"""


setup(long_description=pypi_description(), long_description_content_type="text/markdown")
