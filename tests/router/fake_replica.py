"""A replica process for router tests: `loom serve`'s app over the fake engine (no model), on a given port.

python -m tests.router.fake_replica PORT [STEP_DELAY_S]
"""

from __future__ import annotations

import sys

import uvicorn

from loom.engine.async_engine import AsyncLLMEngine
from loom.server.api_server import build_app
from tests.server.fake_engine import FakeEngine


def main() -> None:
    port = int(sys.argv[1])
    step_delay_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    front = AsyncLLMEngine(FakeEngine(step_delay_s=step_delay_s, max_waiting_requests=256), idle_poll_s=0.05)
    front.start()
    uvicorn.run(build_app(front), host="127.0.0.1", port=port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
