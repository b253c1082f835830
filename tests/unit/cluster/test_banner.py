"""The ready banner's context line: what limits a request, and which knob raises it."""

from __future__ import annotations

import pathlib
import types

import pytest

from services.cluster.launcher import ClusterSpec, LocalCluster
from services.cluster.ready_banner import NUM_BLOCKS_VARIABLE, Serving, ready_banner


def banner(tmp_path, serving: Serving) -> str:
    spec = ClusterSpec(model_dir=pathlib.Path("/models/tiny"), roles=("both",), num_managers=1, engine="torch",
                       transfer_backend="grpc", http_port=8000, admin_port=50051, state_dir=tmp_path, cluster="ferry",
                       threads_per_instance=1, kv_cache_mib=16, log_format="console")
    cluster = LocalCluster(spec)
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")
    return ready_banner(cluster, serving)


def test_a_small_kv_cache_names_its_size_and_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(NUM_BLOCKS_VARIABLE, raising=False)
    text = banner(tmp_path, Serving(640, (), kv_tokens=640))
    assert "640 tokens per request" in text
    assert "that is all a 16 MiB KV cache holds; raise --kv-cache-mib" in text


def test_a_block_count_from_the_environment_is_named_instead(tmp_path, monkeypatch):
    monkeypatch.setenv(NUM_BLOCKS_VARIABLE, "40")
    text = banner(tmp_path, Serving(640, (), kv_tokens=640))
    assert f"a KV cache of 40 blocks ({NUM_BLOCKS_VARIABLE}) holds; raise {NUM_BLOCKS_VARIABLE}" in text


@pytest.mark.parametrize("kv_tokens", [100_000, 0])
def test_a_short_model_context_is_not_blamed_on_the_kv_cache(tmp_path, kv_tokens):
    text = banner(tmp_path, Serving(512, (), kv_tokens=kv_tokens))
    assert "512 tokens per request" in text and "the model's own context length" in text
    assert "--kv-cache-mib" not in text


def test_a_long_context_needs_no_remark(tmp_path):
    text = banner(tmp_path, Serving(8192, (), kv_tokens=8192))
    assert "warning" not in text and "note" not in text


def test_the_banner_says_to_activate_the_virtualenv_its_commands_need(tmp_path, monkeypatch):
    """`make run` runs .venv/bin/python; a shell's `python` (and `grpcurl`) is another one."""
    monkeypatch.setattr("sys.prefix", "/repo/.venv")
    monkeypatch.setattr("sys.executable", "/repo/.venv/bin/python")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/python")
    assert "source /repo/.venv/bin/activate" in banner(tmp_path, Serving(640, (), kv_tokens=0))
    monkeypatch.setattr("shutil.which", lambda name: "/repo/.venv/bin/python")  # activated already
    assert "activate" not in banner(tmp_path, Serving(640, (), kv_tokens=0))


def test_drain_marks_and_roles_set_at_runtime_kept_from_an_earlier_run_are_named(tmp_path):
    # A kept --state-dir brings them back silently otherwise: `--decode-instances 2` gave 1 decode and
    # 1 both in a fault run.
    text = banner(tmp_path, Serving(8192, ("instance-2",), kv_tokens=8192, roles_set=(("instance-1", "both"),)))
    assert "drained    : instance-2" in text
    assert "role       : instance-1 is both, set at runtime" in text and "role instance-1" in text
