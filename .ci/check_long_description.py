"""Fail when the long description in a wheel's METADATA holds a relative link or image (PyPI
cannot resolve them): ``python .ci/check_long_description.py dist/*.whl``."""

import re
import sys
import zipfile

RELATIVE = re.compile(r"!?\[[^\]]*\]\((?!https?://|#)[^)]*\)")

failed = False
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        description = archive.read(metadata).decode().partition("\n\n")[2]
    found = RELATIVE.findall(description)
    if not description.strip() or found:
        failed = True
        print(f"{wheel}: long description {'is empty' if not found else 'has relative links: ' + ', '.join(found)}")
    else:
        print(f"{wheel}: long description has no relative link or image ({len(description)} characters)")
sys.exit(1 if failed else 0)
