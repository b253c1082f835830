"""The sim profiler: its fit recovers a known latency model (a sim engine profiled on a clock
that only its sleeps advance), and its command prints flags the instance accepts."""

import os
import types
import uuid

import pytest
import torch

from services.common.config import parse_config
from services.instance.config import InstanceConfig
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.model_config import ModelConfig
from services.instance.engine.sim_model import SimLatency, SimModel
from services.instance.engine import sim_model, sim_profile
from services.instance.engine.sim_profile import main, profile
from services.instance.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)


class SleepClock:
    """A clock that only `sleep` moves: each timed step lasts exactly what the sim model slept."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now


def test_the_fit_recovers_a_known_latency_model(tiny_model_dir, monkeypatch):
    # On the wall clock, a loaded 2-core machine (two test workers) stretched the engine's own work and the
    # sleeps' wake-ups by up to ~10 ms a step: the fit's terms left any bound near the known ones (flaky).
    # Here the steps' times are the model's sleeps alone, so the fit must recover the known model exactly.
    clock = SleepClock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(sim_profile, "time", fake_time)
    monkeypatch.setattr(sim_model, "time", fake_time)
    config = ModelConfig.from_dir(tiny_model_dir)
    geometry = KvGeometry(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16, 64, torch.float32)
    cache = KvCache.create(f"ferry-kv-test-profile-{os.getpid()}-{uuid.uuid4().hex[:8]}", geometry)
    try:
        known = SimLatency(step_ms=30.0, prefill_ms_per_token=1.0, decode_ms_per_seq=5.0)
        engine = LLMEngine(SimModel(config, known, sleep=clock.sleep), Tokenizer.from_dir(tiny_model_dir), cache,
                           EngineConfig(num_blocks=64, max_model_len=256, block_size=16, max_num_seqs=4,
                                        max_num_batched_tokens=256))
        fitted = profile(engine, batch_size=4, prompt_tokens=64, repeats=3)
    finally:
        cache.close()
        cache.unlink()
    assert fitted.step_ms == pytest.approx(known.step_ms), fitted
    assert fitted.decode_ms_per_seq == pytest.approx(known.decode_ms_per_seq), fitted
    assert fitted.prefill_ms_per_token == pytest.approx(known.prefill_ms_per_token), fitted


def test_prints_flags_the_instance_accepts(tiny_model_dir, capsys):
    main(["--model", str(tiny_model_dir), "--batch-size", "2", "--prompt-tokens", "32", "--repeats", "1",
          "--num-threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("--engine sim")):]  # after any log lines
    parsed = parse_config(InstanceConfig, "instance", ["--model", "m", *lines[0].split()], env={})
    printed = dict(zip(lines[0].split()[::2], lines[0].split()[1::2], strict=True))
    assert parsed.engine.value == "sim"
    # One noisy step per point may fit a term to 0 (clamped, never negative); the flags carry what was fitted.
    assert parsed.sim_step_ms == float(printed["--sim-step-ms"]) >= 0
    assert parsed.sim_prefill_ms_per_token == float(printed["--sim-prefill-ms-per-token"]) >= 0
    assert parsed.sim_decode_ms_per_seq == float(printed["--sim-decode-ms-per-seq"]) >= 0
    assert lines[1] == f"FERRY_INSTANCE_SIM_STEP_MS={printed['--sim-step-ms']}"
