"""Packaging shim: the metadata is in setup.cfg. Only the long description is built here: PyPI
shows README.md, but resolves no relative image or link, so images with a relative path are
left out and relative links keep their text (the repository's README keeps both)."""

import re
from pathlib import Path

from setuptools import setup


def pypi_description() -> str:
    text = (Path(__file__).parent / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"(?m)^!\[[^\]]*\]\((?!https?://)[^)]*\)\n\n?", "", text)
    return re.sub(r"\[([^\]]+)\]\((?!https?://|#)[^)]*\)", r"\1", text)


setup(long_description=pypi_description(), long_description_content_type="text/markdown")
