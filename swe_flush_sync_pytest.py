"""The pytest plugin of ``swe_flush_sync`` (loaded through the ``pytest11`` entry point, named
``swe_flush_sync``): the ``agent_server`` fixture, and ``agent_server_tls`` for the same over https.

A top-level module, so that loading it imports nothing of the package: pytest loads it in every
run where the package is installed, and ``import swe_flush_sync`` binds every public name at once
(requests included). The fixtures import the stub when a test asks for one.

Examples:
    ```python
    def test_my_abort(agent_server):
        agent_server.add_trials("inst-1", 2)
        agent_server.fault("inst-2", statuses=[503])
        report = flush(agent_server.url, ["inst-1", "inst-2"])
        assert report.ok and sorted(agent_server.flushed_ids()) == ["inst-1", "inst-2"]
    ```
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from swe_flush_sync.testing import AgentServerStub


@pytest.fixture
def agent_server() -> Iterator[AgentServerStub]:
    """A started stub agent server on 127.0.0.1 (no secret required), stopped after the test.

    Script faults with ``fault(id, ...)``, start runs with ``add_trials``, read ``requests`` /
    ``flushed_ids()``; set ``secret`` or ``scoped_secret`` to require a bearer, ``max_concurrent``
    to make runs beyond that many wait for a slot, as the bridge does.
    """
    from swe_flush_sync.testing import AgentServerStub

    with AgentServerStub() as server:
        yield server


@pytest.fixture
def agent_server_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentServerStub]:
    """The same stub serving https, with a certificate for 127.0.0.1 made by ``trustme`` (skipped
    where trustme is not installed). Trust it with ``ca_bundle=agent_server_tls.ca_bundle``.

    Examples:
        ```python
        def test_my_abort_over_tls(agent_server_tls):
            report = flush(agent_server_tls.url, ["inst-1"], ca_bundle=agent_server_tls.ca_bundle)
        ```
    """
    from swe_flush_sync.testing import AgentServerStub

    trustme = pytest.importorskip("trustme")
    authority = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    ca_file = tmp_path_factory.mktemp("agent-server-ca") / "ca.pem"
    authority.cert_pem.write_to_path(str(ca_file))
    with AgentServerStub(tls=context, ca_bundle=str(ca_file)) as server:
        yield server
