"""`python -m services.transfer`: moves KV cache blocks between instances' KV memory."""

import asyncio

from services.common.config import parse_config
from services.common.logging import LogFormat, setup_logging
from services.transfer.app import main
from services.transfer.config import TransferConfig


def run() -> None:
    config = parse_config(TransferConfig, "transfer")
    setup_logging("transfer", LogFormat(config.log_format), config.log_level)
    asyncio.run(main(config))


if __name__ == "__main__":
    run()
