"""Not a test module: `make lint` checks that mypy rejects each misspelt option below."""

from swe_flush_sync import Flusher, abort, abort_async, flush


async def misspelt() -> None:
    abort({}, dealine=10)
    await abort_async({}, max_worker=4)
    flush("http://127.0.0.1:9", ["a"], retry=2)
    Flusher("http://127.0.0.1:9", linge=0)
