"""`python -m services.transfer`: moves KV cache blocks between instances' KV memory."""

from services.common.config import parse_config
from services.common.startup import run_service
from services.transfer.app import main
from services.transfer.config import TransferConfig


def run() -> None:
    config = parse_config(TransferConfig, "transfer")
    config.setup_logging("transfer")
    run_service(main(config))


if __name__ == "__main__":
    run()
