"""A small FastAPI app with the public Harbor bridge's ``/flush`` semantics, written for these tests.

As the bridge does: a pydantic body (422 on a bad one), the whole ``Authorization`` value
compared with ``secrets.compare_digest`` against the admin secret, else the auth token (with
neither, /flush is open), or, in scoped mode, against the per-instance bearer; in-flight
trials held as asyncio tasks that a flush cancels and awaits; a trial stays registered until
its teardown ends, so a second flush meanwhile cancels it again, mid-teardown (counted). At most
``max_concurrent`` trials run at once behind an ``asyncio.Semaphore`` (the bridge's
``AGENT_MAX_CONCURRENT``), and a run registers for /flush only once it holds a slot, as the
bridge's ``/run`` does: runs still waiting are not cancelled by a flush, and start when a slot frees.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel


class FlushRequest(BaseModel):
    session_server_instance_id: str


class TrialsRequest(BaseModel):
    session_server_instance_id: str
    count: int = 1


@dataclass
class Stats:
    flushes: list[str] = field(default_factory=list)
    interrupted_teardowns: int = 0
    runs: set[asyncio.Task[None]] = field(default_factory=set)  # started and not ended: running or waiting

    def running_or_waiting(self) -> int:
        return sum(1 for run in self.runs if not run.done())


def scoped_bearer(master: str, instance_id: str) -> str:
    message = b"miles-harbor-flush-session-v1\x00" + b"session:" + instance_id.encode()
    return hmac.new(master.encode(), message, hashlib.sha256).hexdigest()


def create_app(*, admin_secret: str = "", auth_token: str = "", run_secret: str = "",
               teardown: float = 0.2, max_concurrent: int = 10_000) -> tuple[FastAPI, Stats]:
    app = FastAPI(title="Harbor bridge /flush contract")
    active: dict[str, set[asyncio.Task[None]]] = {}
    stats = Stats()
    semaphore = asyncio.Semaphore(max_concurrent)

    def require_bearer(http_request: Request, instance_id: str) -> None:
        if run_secret:
            expected = [f"Bearer {scoped_bearer(run_secret, instance_id)}"]
        else:
            expected = [f"Bearer {token}" for token in (admin_secret or auth_token,) if token]
        header = http_request.headers.get("authorization", "")
        if expected and not any(secrets.compare_digest(header, item) for item in expected):
            raise HTTPException(status_code=401, detail="Invalid bearer token")

    async def trial() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            try:
                await asyncio.sleep(teardown)  # containers being torn down
            except asyncio.CancelledError:
                stats.interrupted_teardowns += 1
            raise

    async def run(instance_id: str) -> None:  # the bridge's /run, whose client has gone
        async with semaphore:
            task = asyncio.current_task()
            assert task is not None
            active.setdefault(instance_id, set()).add(task)
            try:
                await trial()
            finally:  # registered until its teardown ends
                active[instance_id].discard(task)

    @app.post("/trials")
    async def start_trials(payload: TrialsRequest) -> dict[str, Any]:
        for _ in range(payload.count):
            stats.runs.add(asyncio.create_task(run(payload.session_server_instance_id)))
        await asyncio.sleep(0)  # let the runs that get a slot register
        return {"started": payload.count}

    @app.post("/flush")
    async def flush(payload: FlushRequest, http_request: Request) -> dict[str, Any]:
        require_bearer(http_request, payload.session_server_instance_id)
        stats.flushes.append(payload.session_server_instance_id)
        current = asyncio.current_task()
        tasks = [t for t in active.get(payload.session_server_instance_id, set()) if t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return {"session_server_instance_id": payload.session_server_instance_id, "cancelled": len(tasks)}

    return app, stats
