"""Entry point of ``zeroserve gateway``: the Starlette app under uvicorn."""

from __future__ import annotations

import logging
import os
from typing import Any

import uvicorn

from zeroserve.gateway.app import Settings, create_app

logger = logging.getLogger(__name__)


def run_gateway(frontend: str, args: Any) -> int:
    app = create_app(Settings(frontend=frontend, max_body_bytes=args.max_body_bytes,
                              admin_token=os.environ.get("ZEROSERVE_ADMIN_TOKEN", "")))
    config = uvicorn.Config(app, host=args.http_host, port=args.http_port,
                            loop="uvloop", http="httptools", access_log=False,
                            log_level=args.log_level, log_config=None,
                            timeout_graceful_shutdown=30)
    logger.info("gateway on http://%s:%d, broker %s", args.http_host, args.http_port, frontend)
    uvicorn.Server(config).run()
    return 0
