"""`python -m services.frontend`: the OpenAI-compatible HTTP API of a ferry cluster."""

from services.common.startup import run_service
from services.frontend.app import main
from services.frontend.config import load_config


def run() -> None:
    config = load_config()
    config.setup_logging("frontend")
    run_service(main(config))


if __name__ == "__main__":
    run()
