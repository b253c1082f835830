"""Which FERRY_<SERVICE>_<FIELD> variables each service understands (from its config dataclass)."""

from __future__ import annotations

import dataclasses
import importlib
import re

SERVICE_CONFIGS = {
    "manager": ("services.manager.config", "ManagerConfig"),
    "instance": ("services.instance.config", "InstanceConfig"),
    "frontend": ("services.frontend.config", "FrontendConfig"),
    "transfer": ("services.transfer.config", "TransferConfig"),
    "ctl": ("services.ctl.config", "CtlConfig"),
}
_VARIABLE = re.compile(r"\bFERRY_(MANAGER|INSTANCE|FRONTEND|TRANSFER|CTL)_([A-Z0-9_]+)\b")


def config_fields(service: str) -> set[str] | None:
    """Field names of the service's config, or None while the service has no config module."""
    module_name, class_name = SERVICE_CONFIGS[service]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return None
    return {field.name for field in dataclasses.fields(getattr(module, class_name))} | {"config"}


# Services still being written: their variables are checked once their config.py exists.
UNWRITTEN_OK = frozenset({"transfer"})


def unknown_variables(text: str) -> dict[str, list[str]]:
    """Per service, the FERRY_* names in `text` that its config does not have."""
    unknown: dict[str, list[str]] = {}
    for service, field in sorted(set(_VARIABLE.findall(text))):
        fields = config_fields(service.lower())
        if fields is None:
            if service.lower() not in UNWRITTEN_OK:
                unknown.setdefault(service.lower(), []).append(f"services/{service.lower()}/config.py is missing")
        elif field.lower() not in fields:
            unknown.setdefault(service.lower(), []).append(f"FERRY_{service}_{field}")
    return unknown
