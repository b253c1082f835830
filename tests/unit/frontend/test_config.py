"""Frontend flags: repeated list flags, required sources, validation."""

from __future__ import annotations

import pytest

from services.frontend.config import load_config

pytestmark = pytest.mark.timeout(10)


def test_api_keys_repeat_or_comma_separate():
    config = load_config(["--etcd-endpoints", "h:1", "--api-key", "a", "--api-key=b,c", "--api-key", "d"])
    assert config.api_key == ["a", "b", "c", "d"]
    assert config.etcd_endpoints == ["h:1"]
    origins = load_config(["--manager-address", "m:1", "--allowed-origins", "https://a.example",
                           "--allowed-origins=https://b.example"])
    assert origins.allowed_origins == ["https://a.example", "https://b.example"]


def test_defaults_and_model_name(tmp_path):
    config = load_config(["--model", str(tmp_path / "tiny-x"), "--manager-address", "m:1"])
    assert config.model_name == "tiny-x" and config.port == 8000 and config.dispatch_timeout_s == 0.2
    assert config.max_resumes == 3 and config.resume_wait_s == 30.0 and config.max_body_bytes == 1 << 20 and config.api_key == []
    named = load_config(["--manager-address", "m:1", "--served-model-name", "served"])
    assert named.model_name == "served"


def test_needs_etcd_or_a_manager(capsys):
    with pytest.raises(SystemExit):
        load_config([])
    assert "--etcd-endpoints" in capsys.readouterr().err


def test_rejects_nonsense(capsys):
    with pytest.raises(SystemExit):
        load_config(["--manager-address", "m:1", "--max-inflight", "0"])
    assert "--max-inflight must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-handoffs", "0", "--max-handoffs must be >= 1"),
    ("--etcd-wait-s", "-1", "--etcd-wait-s must be 0..86400"),
    ("--resume-wait-s", "-1", "--resume-wait-s must be >= 0"),
])
def test_rejects_values_that_would_break_a_request_or_the_start(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        load_config(["--manager-address", "m:1", flag, value])
    assert message in capsys.readouterr().err
