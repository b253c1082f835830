"""`python -m services.instance`: one inference engine served over gRPC."""

from services.common.config import parse_config
from services.common.startup import run_service
from services.instance.app import main
from services.instance.config import InstanceConfig


def run() -> None:
    config = parse_config(InstanceConfig, "instance")
    config.setup_logging("instance")
    run_service(main(config))


if __name__ == "__main__":
    run()
