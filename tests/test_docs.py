"""The documentation's examples run, and the framework hook works the way the framework loads it.

Every ```python block of README.md and docs/*.md runs here against the stub, in a fresh
interpreter: a block defining ``test_*`` functions runs under pytest (the package's own
fixtures), exactly as written, imports included; any other as a script with the trainer's names
filled in (``args``, ``num_steps``, ...). A block preceded by ``<!-- excerpt: why -->`` is not run
(it needs Ray, say); the marker says so in the page's source.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from swe_flush_sync.testing import AgentServerStub

from .conftest import PYTHON, REPO, SECRET, _watchdog_pids, read_until, spawn, subprocess_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?P<before>(?:^[^\n]*\n){0,2})^```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
EXCERPT = re.compile(r"<!-- excerpt: [^>]+-->")
GUARD_SOCKET = "/run/swe-flush/guard.sock"  # the placeholder the docs use; each run gets its own
LEDGER = "/checkpoints/"

PRELUDE = """
import argparse, atexit, logging
from swe_flush_sync import *
from swe_flush_sync._watchdog import api as _watchdog
args = argparse.Namespace(session_server_instance_ids={8000: "doc-a", 8001: "doc-b"},
                          session_server_instance_id="doc-c")
num_steps = 2
log = logging.getLogger("trainer")
def collect_until_enough(args): return []
def train_on(samples): pass
def main(args): pass
atexit.register(lambda: print("WATCHDOGS", *[dog.pid for dog in _watchdog._watchdogs if not dog.guard],
                              flush=True))
"""


def examples() -> list[tuple[str, str, str | None]]:
    """(id, code, why it is an excerpt or None) for every python block of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            excerpt = EXCERPT.search(match.group("before"))
            line = text.count("\n", 0, match.start("code"))  # the line of its opening fence
            found.append((f"{page.name}:{line}", match.group("code"), excerpt.group(0) if excerpt else None))
    return found


EXAMPLES = examples()


def test_there_are_examples_and_few_excerpts() -> None:
    assert len(EXAMPLES) >= 15
    assert sum(why is not None for _, _, why in EXAMPLES) <= 2


@pytest.mark.parametrize(("name", "code", "excerpt"), EXAMPLES, ids=[name for name, _, _ in EXAMPLES])
def test_example_runs(name: str, code: str, excerpt: str | None, stub: AgentServerStub, short_dir: Path) -> None:
    if excerpt is not None:
        pytest.skip(f"the python block at line {name.partition(':')[2]} of {name.partition(':')[0]} is marked "
                    f"as an excerpt: {excerpt}")
    env = subprocess_env(AGENT_SERVER_URL=stub.url, HARBOR_ADMIN_SECRET=SECRET)
    code = code.replace(LEDGER, f"{short_dir}/checkpoints/")
    if GUARD_SOCKET in code:
        socket_path = str(short_dir / "guard.sock")
        code = code.replace(GUARD_SOCKET, socket_path)
        guard = spawn([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", socket_path], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, env=subprocess_env())
        assert read_until(guard, lambda line: line.startswith("guarding "), []) is not None
    if "def test_" in code:
        script = short_dir / "test_example.py"
        script.write_text(code)  # as written: a user copies it into a test file of their own
        run = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)],
                             capture_output=True, text=True, env=env, timeout=120, cwd=short_dir)
        assert run.returncode == 0 and " passed" in run.stdout, run.stdout + run.stderr
        return
    run = subprocess.run([PYTHON, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=120, cwd=short_dir)
    for line in run.stdout.splitlines():
        if line.startswith("WATCHDOGS"):
            _watchdog_pids.extend(int(pid) for pid in line.split()[1:])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_the_framework_hook_as_the_framework_loads_it(stub: AgentServerStub, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent module named by --custom-agent-function-path, with the one line the docs give."""
    module_file = tmp_path / "swe_agent_function.py"
    module_file.write_text(textwrap.dedent("""
        from swe_flush_sync import abort_async as abort


        async def run(base_url, request_kwargs, **_):  # the agent function
            raise AssertionError("not called by an abort")
    """))
    monkeypatch.setenv("AGENT_SERVER_URL", stub.url)
    monkeypatch.setenv("HARBOR_ADMIN_SECRET", SECRET)
    for instance_id in ("fw-a", "fw-b"):
        stub.add_trials(instance_id, 2)
    spec = importlib.util.spec_from_file_location("swe_agent_function", module_file)  # by its path
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hook = getattr(module, "abort", None)
    assert hook is not None and inspect.iscoroutinefunction(hook)
    args = argparse.Namespace(session_server_instance_ids={30000: "fw-a", 30001: "fw-b"},
                              session_server_instance_id="fw-a")
    report = asyncio.run(hook(args))
    assert report.ok and report.cancelled == 4 and sorted(stub.flushed_ids()) == ["fw-a", "fw-b"]


def _block(page: str, language: str, containing: str) -> str:
    """The one ```language block of ``page`` that contains ``containing``."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```$", (REPO / "docs" / page).read_text(), re.MULTILINE | re.DOTALL)
    [block] = [block for block in blocks if containing in block]
    return str(block)


def test_the_prestop_recipe_flushes_with_the_bearer_it_is_given(tmp_path: Path) -> None:
    """The preStop hook of docs/deployment.md, as written: its command, with only the env vars its pod spec sets."""
    block = _block("deployment.md", "yaml", "preStop")
    command = json.loads(re.search(r"command: (\[.*\])", block).group(1))  # type: ignore[union-attr]
    names = set(re.findall(r"name: ([A-Z_]+)", block))
    assert command[0] == "swe-flush" and {"AGENT_SERVER_URL", "HARBOR_ADMIN_SECRET"} <= names
    ids = tmp_path / "session-servers.json"
    ids.write_text(json.dumps({"session_server_instance_ids": {"30000": "pre-a"},
                               "session_server_instance_id": "pre-b"}))
    with AgentServerStub(secret=SECRET) as server:  # checks the bearer: 401 without it
        values = {"AGENT_SERVER_URL": server.url, "HARBOR_ADMIN_SECRET": SECRET}
        env = subprocess_env(**{name: values[name] for name in names if name in values})
        argv = [arg.replace("/tmp/session-servers.json", str(ids)) for arg in command[1:]]
        run = subprocess.run([PYTHON, "-m", "swe_flush_sync", *argv], capture_output=True, text=True, env=env,
                             timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        assert sorted(server.flushed_ids()) == ["pre-a", "pre-b"] and all(r.status == 200 for r in server.requests)


def test_the_slurm_wrapper_flushes_when_term_arrives_not_when_the_trainer_ends(tmp_path: Path) -> None:
    """The batch script of docs/deployment.md, run by a real bash that really gets SIGTERM."""
    script = _block("deployment.md", "bash", "trap").replace("/tmp/session-servers.json", str(tmp_path / "ids.json"))
    (tmp_path / "ids.json").write_text(json.dumps({"session_server_instance_id": "slurm-a"}))
    (tmp_path / "train.py").write_text("import time\nprint('TRAINING', flush=True)\ntime.sleep(120)\n")
    (tmp_path / "train.sh").write_text(script)
    bin_dir = os.path.dirname(PYTHON)  # python and swe-flush, as the job's environment has them
    with AgentServerStub(secret=SECRET) as server:
        env = subprocess_env(AGENT_SERVER_URL=server.url, HARBOR_ADMIN_SECRET=SECRET,
                             PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        batch = spawn(["bash", str(tmp_path / "train.sh")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                      cwd=tmp_path, start_new_session=True)
        assert read_until(batch, lambda line: line == "TRAINING", []) is not None
        batch.send_signal(signal.SIGTERM)  # sbatch --signal=B:TERM: to the batch shell only
        sent = time.monotonic()
        batch.wait(30)  # the trap flushed, stopped the trainer, and the script ended
        assert server.flushed_ids() == ["slurm-a"] and server.requests[0].status == 200
        assert server.requests[0].at - sent < 10  # at the TERM, not 120 s later when the trainer would end
        assert time.monotonic() - sent < 30


def test_the_configuration_page_lists_every_variable_the_code_reads() -> None:
    """Every environment variable name the package defines (the ``*_ENV_VAR(S)`` constants, the
    only way it reads the environment) has a row on docs/configuration.md, and no row names one it does not read."""
    from swe_flush_sync._core import resolve as _resolve
    from swe_flush_sync._core import tls as _tls
    from swe_flush_sync._watchdog import api as _watchdog

    read = {*_resolve.URL_ENV_VARS, *_resolve.SECRET_ENV_VARS, _resolve.RUN_SECRET_ENV_VAR, *_tls.CA_BUNDLE_ENV_VARS,
            _watchdog.LEDGER_ENV_VAR, _watchdog.GUARD_ENV_VAR}
    page = (REPO / "docs" / "configuration.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split(" | ")[0])}
    assert listed == read
    package = Path(_resolve.__file__).parent.parent  # the package under test: the checkout, or an installed wheel
    sources = "".join(path.read_text() for path in package.rglob("*.py"))
    constants = set(re.findall(r"^([A-Z_]*ENV_VARS?): Final = ", sources, re.MULTILINE))
    assert constants == {"URL_ENV_VARS", "SECRET_ENV_VARS", "RUN_SECRET_ENV_VAR", "CA_BUNDLE_ENV_VARS",
                         "LEDGER_ENV_VAR", "GUARD_ENV_VAR"}  # a new one fails here until it is listed above


def test_the_reference_renders_examples_as_code() -> None:
    """The API reference (mkdocstrings) shows each docstring's ``Examples:`` as a code block, never as
    the nested blockquotes a ``>>>`` under ``Example:`` became."""
    page = REPO / "build" / "site" / "reference" / "index.html"
    if not page.exists():
        pytest.skip("the site is not built here (make docs builds it; CI builds it before the suite)")
    html = page.read_text()
    quotes = re.findall(r"<blockquote.*?</blockquote>", html, re.DOTALL)
    assert [quote for quote in quotes if "<code" in quote or "&gt;&gt;&gt;" in quote] == []
    sections = re.findall(r'doc-section-title">Examples:</span></p>\s*<div class="highlight"><pre>', html)
    assert len(sections) == html.count('doc-section-title">Examples:') >= 15


def _transcript(page: str, containing: str) -> list[tuple[str, list[str]]]:
    """The ``$ command`` lines of the plain ``` block of ``page`` that holds ``containing``, each with its output."""
    blocks, block, inside = [], [], False
    for line in (REPO / "docs" / page).read_text().splitlines():
        if line.startswith("```"):
            if inside:
                blocks.append(block)
            block, inside = [], not inside and line == "```"
        elif inside:
            block.append(line)
    [lines] = [lines for lines in blocks if containing in "\n".join(lines)]
    steps: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def test_the_cli_pages_doctor_transcript_is_what_doctor_says(short_dir: Path) -> None:
    """docs/cli.md's doctor run, command by command (a guard, a ledger, then a wrong bearer): each check
    says what the page shows (its status and name; the container check's status depends on the host)."""
    steps = _transcript("cli.md", "$ swe-flush doctor")
    socket_path, ledger = str(short_dir / "run" / "guard.sock"), short_dir / "ckpt"
    ledger.mkdir(mode=0o700)
    guard = spawn([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", socket_path], stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, env=subprocess_env())
    assert read_until(guard, lambda line: line.startswith("guarding "), []) is not None
    with AgentServerStub(secret=SECRET) as server, contextlib.ExitStack() as ending:
        ending.callback(guard.wait, 10)
        ending.callback(guard.kill)
        script = "".join(f'{command}; rc=$?; echo "::END::"; (exit $rc)\n' for command, _ in steps)
        env = subprocess_env(AGENT_SERVER_URL=server.url, HARBOR_ADMIN_SECRET=SECRET, SWE_FLUSH_GUARD=socket_path,
                             SWE_FLUSH_LEDGER=str(ledger),
                             PATH=os.path.dirname(PYTHON) + os.pathsep + os.environ.get("PATH", ""))
        run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    outputs = run.stdout.split("::END::\n")
    assert len(outputs) == len(steps) + 1, run.stdout + run.stderr

    def checks(lines: list[str]) -> list[str]:
        said = [" ".join(line.split(":")[0].split()[:2]) for line in lines]  # "ok servers", "fail server"
        return [("container" if check.endswith(" container") else check) for check in said]

    for (command, shown_lines), output in zip(steps, outputs, strict=False):
        if command.startswith("echo"):
            assert output.split() == shown_lines, (command, output)
        else:
            assert checks(output.splitlines()) == checks(shown_lines), (command, output)
