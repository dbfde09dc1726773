"""The stub agent server in its own process, scripted over stdin/stdout (JSON lines).

Keeping the server out of the measuring process keeps its threads off the measured GIL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from swe_flush_sync.testing import AgentServerStub


def serve() -> None:
    """Child side: start the stub, print its URL, answer commands until stdin closes."""
    with AgentServerStub(secret=sys.argv[2] if len(sys.argv) > 2 else None) as stub:
        print(json.dumps({"url": stub.url}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            reply: Any = None
            if op == "teardown":
                stub.teardown = command["seconds"]
            elif op == "fault":
                stub.fault(command.pop("instance_id"), **command)
            elif op == "slots":
                stub.max_concurrent = command["max_concurrent"]
            elif op == "add_trials":
                stub.add_trials(command["instance_id"], command["count"])
            elif op == "stats":
                seen = {r.instance_id for r in stub.requests if r.instance_id}
                reply = {"connections": stub.connections, "requests": len(stub.requests), "flushed": stub.flushed_ids(),
                         "running": sum(stub.trials(i) for i in seen), "waiting": stub.waiting()}
            elif op == "clear":
                stub.clear_requests()
            print(json.dumps({"reply": reply}), flush=True)


class StubProcess:
    """Parent side: a context manager around the child."""

    def __init__(self, secret: str | None = None) -> None:
        argv = [sys.executable, "-m", "benchmarks.stub_process", "serve"] + ([secret] if secret else [])
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        self.url: str = json.loads(self._proc.stdout.readline())["url"]

    def _call(self, **command: Any) -> Any:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return json.loads(self._proc.stdout.readline())["reply"]

    def teardown(self, seconds: float) -> None:
        self._call(op="teardown", seconds=seconds)

    def fault(self, instance_id: str, **kwargs: Any) -> None:
        self._call(op="fault", instance_id=instance_id, **kwargs)

    def slots(self, max_concurrent: int | None) -> None:
        self._call(op="slots", max_concurrent=max_concurrent)

    def add_trials(self, instance_id: str, count: int) -> None:
        self._call(op="add_trials", instance_id=instance_id, count=count)

    def stats(self) -> dict[str, Any]:
        return self._call(op="stats")  # type: ignore[no-any-return]

    def clear(self) -> None:
        self._call(op="clear")

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def __enter__(self) -> StubProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve()
