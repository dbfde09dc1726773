"""Test helpers for users of swe_flush_sync: a stub agent server on real loopback sockets.

Examples:
    ```python
    from swe_flush_sync.testing import AgentServerStub
    with AgentServerStub(secret="s3cret") as stub:
        stub.fault("inst-2", statuses=[503])
        report = flush(stub.url, ["inst-1", "inst-2"], admin_secret="s3cret")
        assert sorted(stub.flushed_ids()) == ["inst-1", "inst-2"]
    ```
"""

from ._stub import AgentServerStub, RecordedRequest

__all__ = ["AgentServerStub", "RecordedRequest"]
