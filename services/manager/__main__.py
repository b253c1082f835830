"""`python -m services.manager`: cluster view, dispatch and admin API, with leader election."""

from services.common.config import parse_config
from services.common.startup import run_service
from services.manager.app import main
from services.manager.config import ManagerConfig


def run() -> None:
    config = parse_config(ManagerConfig, "manager")
    config.setup_logging("manager")
    run_service(main(config))


if __name__ == "__main__":
    run()
