"""`python -m services.manager`: cluster view, dispatch and admin API, with leader election."""

import asyncio

from services.common.config import parse_config
from services.common.logging import LogFormat, setup_logging
from services.manager.app import main
from services.manager.config import ManagerConfig


def run() -> None:
    config = parse_config(ManagerConfig, "manager")
    setup_logging("manager", LogFormat(config.log_format), config.log_level)
    asyncio.run(main(config))


if __name__ == "__main__":
    run()
