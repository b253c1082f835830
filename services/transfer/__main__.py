"""`python -m services.transfer`: moves KV cache blocks between instances' KV memory."""

import asyncio

from services.common.config import parse_config
from services.transfer.app import main
from services.transfer.config import TransferConfig


def run() -> None:
    config = parse_config(TransferConfig, "transfer")
    config.setup_logging("transfer")
    asyncio.run(main(config))


if __name__ == "__main__":
    run()
