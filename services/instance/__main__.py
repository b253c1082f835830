"""`python -m services.instance`: one inference engine served over gRPC."""

import asyncio

from services.common.config import parse_config
from services.common.logging import LogFormat, setup_logging
from services.instance.app import main
from services.instance.config import InstanceConfig


def run() -> None:
    config = parse_config(InstanceConfig, "instance")
    setup_logging("instance", LogFormat(config.log_format), config.log_level)
    asyncio.run(main(config))


if __name__ == "__main__":
    run()
