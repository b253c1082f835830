"""--metrics-host on every service that has a --metrics-port: a flag with help and a
FERRY_<SERVICE>_METRICS_HOST variable, empty by default (then /metrics binds --host, as before)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import knob_help, parse_config
from services.instance.config import InstanceConfig
from services.manager.config import ManagerConfig
from services.transfer.config import TransferConfig

pytestmark = pytest.mark.timeout(10)

SERVICES = [(ManagerConfig, "manager"), (InstanceConfig, "instance"), (TransferConfig, "transfer")]


@pytest.mark.parametrize(("cls", "service"), SERVICES, ids=[s for _, s in SERVICES])
def test_metrics_host_is_a_flag_and_a_variable_defaulting_to_host(cls, service):
    [field] = [f for f in dataclasses.fields(cls) if f.name == "metrics_host"]
    assert "--host" in knob_help(field)
    assert parse_config(cls, service, [], env={}).metrics_host == ""
    assert parse_config(cls, service, ["--metrics-host", "0.0.0.0"], env={}).metrics_host == "0.0.0.0"
    env = {f"FERRY_{service.upper()}_METRICS_HOST": "10.0.0.5"}
    assert parse_config(cls, service, [], env=env).metrics_host == "10.0.0.5"
