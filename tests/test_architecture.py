"""The package's layout: no import circles, each room imports only the rooms below it, the watchdog
process waits on the standard library alone, and docs/architecture.md shows the code as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import PYTHON, subprocess_env
from .import_graph import MAY_IMPORT, PACKAGE, allowed_table, arrows, circles, mermaid, room, rooms

PAGE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def test_no_module_imports_itself_around_a_circle() -> None:
    assert circles(arrows()) == []


def test_each_room_imports_only_the_rooms_below_it() -> None:
    graph = arrows()
    between = rooms(graph)
    for name, targets in between.items():
        if name in MAY_IMPORT:
            assert targets <= MAY_IMPORT[name], (name, targets - MAY_IMPORT[name])
    packages = {room(module) for module in graph if "." in module}
    assert packages <= set(MAY_IMPORT), packages - set(MAY_IMPORT)  # a new room says what it may import


def test_the_watchdog_process_waits_on_the_standard_library_alone() -> None:
    """What the watchdog process imports before its trainer dies: the standard library and the
    package's own standard-library-only modules, never requests, urllib3 or a public name."""
    script = PACKAGE / "_process" / "watchdog_process.py"
    code = (f"import importlib.util, json, sys\n"
            "before = set(sys.modules)\n"
            f"spec = importlib.util.spec_from_file_location('script', {str(script)!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "lean = module.lean_module()\n"  # what _run_as_script imports, then main's own import:
            "importlib.import_module(lean.__package__ + '.watch_loop')\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    loaded = json.loads(subprocess.run([PYTHON, "-I", "-c", code], capture_output=True, text=True, check=True,
                                       env=subprocess_env()).stdout)
    ours = {name for name in loaded if name.split(".")[0] == "_swe_flush_watchdog"}
    others = {name.split(".")[0] for name in loaded} - {"_swe_flush_watchdog", "script"}  # what it imported
    assert others <= set(sys.stdlib_module_names) | set(sys.builtin_module_names), others - set(sys.stdlib_module_names)
    assert {".".join(name.split(".")[1:2]) for name in ours} <= {"", "_core", "_process"}, ours
    core = {name.split(".")[2] for name in ours if name.startswith("_swe_flush_watchdog._core.")}
    assert core <= {"errors", "resolve", "auth", "text"}, core  # as docs/architecture.md says
    assert "swe_flush_sync" not in loaded


def test_the_architecture_page_shows_the_code() -> None:
    page = PAGE.read_text()
    assert f"```mermaid\n{mermaid(arrows())}\n```" in page, "run python -m tests.import_graph and paste its diagram"
    assert allowed_table() in page
