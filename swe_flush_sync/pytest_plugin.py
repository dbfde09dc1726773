"""A pytest plugin (loaded through the ``pytest11`` entry point): the ``agent_server`` fixture.

Example::

    def test_my_abort(agent_server):
        agent_server.add_trials("inst-1", 2)
        agent_server.fault("inst-2", statuses=[503])
        report = flush(agent_server.url, ["inst-1", "inst-2"])
        assert report.ok and sorted(agent_server.flushed_ids()) == ["inst-1", "inst-2"]
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._stub import AgentServerStub


@pytest.fixture
def agent_server() -> Iterator[AgentServerStub]:
    """A started stub agent server on 127.0.0.1 (no secret required), stopped after the test.

    Script faults with ``fault(id, ...)``, start runs with ``add_trials``, read ``requests`` /
    ``flushed_ids()``; set ``secret`` or ``scoped_secret`` to require a bearer, ``max_concurrent``
    to make runs beyond that many wait for a slot, as the bridge does.
    """
    with AgentServerStub() as server:
        yield server
