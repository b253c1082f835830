"""`python -m services.frontend`: the OpenAI-compatible HTTP API of a ferry cluster."""

import asyncio

from services.common.logging import LogFormat, setup_logging
from services.frontend.app import main
from services.frontend.config import load_config


def run() -> None:
    config = load_config()
    setup_logging("frontend", LogFormat(config.log_format), config.log_level)
    asyncio.run(main(config))


if __name__ == "__main__":
    run()
