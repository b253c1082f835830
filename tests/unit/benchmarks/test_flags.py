"""Every benchmark refuses, as a usage error naming the flag, the counts and lists it cannot run
with. Before, each of these was a traceback (engine --repeats 0 after a whole run, --batch 0,
resume_recompute --resumed x, prefill_chunks --chunks foo, block_checksum --geometries foo), a
run of nothing that exited 0 (serving --num-requests 0 started a cluster; load --clients 0), or a
hang until killed (chaos --instances 0, transfer_chaos --workers 0)."""

from __future__ import annotations

import argparse

import pytest

from tests.unit.benchmarks.loading import ROOT
from tests.unit.benchmarks.test_help import built_parser

pytestmark = pytest.mark.timeout(60)

PARSE = argparse.ArgumentParser.parse_args  # before built_parser patches it

CASES = [
    ("engine", ["--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("engine", ["--batch", "0"], "argument --batch: 0 is below 1"),
    ("engine", ["--single-tokens", "1"], "argument --single-tokens: 1 is below 2"),
    ("engine", ["--threads", "two"], "argument --threads: 'two' is not a whole number"),
    ("resume_recompute", ["--resumed", "50,x"], "argument --resumed: 'x' is not comma-separated whole numbers"),
    ("structured_output", ["--fields", "0"], "argument --fields: 0 is below 1"),
    ("prefill_chunks", ["--chunks", "half,foo"], "argument --chunks: 'foo' is not a whole number or one of"),
    ("prefill_chunks", ["--short-lens", "40,0"], "argument --short-lens: 0 is below 1"),
    ("prefix_cache", ["--threads", "0"], "argument --threads: 0 is below 1"),
    ("block_checksum", ["--geometries", "smollm2,gpt2"], "argument --geometries: unknown gpt2 (of smollm2,llama7b)"),
    ("block_checksum", ["--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("cluster_token_cost", ["--streams", "0"], "argument --streams: 0 is below 1"),
    ("serving", ["--num-requests", "0"], "argument --num-requests: 0 is below 1"),
    ("serving", ["--pd", "2"], "argument --pd: '2' is not P:D with 1 or more of each"),
    ("policy_sim", ["--rate", "0"], "argument --rate: 0 is not above 0"),
    ("policy_sim", ["--burstiness", "0"], "argument --burstiness: 0 is not above 0"),
    ("policy_sim", ["--seeds", "0,x"], "argument --seeds: 'x' is not comma-separated whole numbers"),
    ("policy_sim", ["--policies", "load:off,nope:on"], "argument --policies: unknown dispatch policy 'nope' (of load,"),
    ("policy_sim", ["--policies", "load"], "argument --policies: 'load' is not dispatch:on or dispatch:off"),
    ("pd_compare", ["--pd", "1:0"], "argument --pd: '1:0' is not P:D with 1 or more of each"),
    ("pd_compare", ["--variants", "both,pd-fast"], "argument --variants: unknown pd-fast (of both,pd,"),
    ("pd_compare", ["--freeze-decode", "2s"], "argument --freeze-decode: want AT:FOR in seconds (e.g. 2:8), got '2s'"),
    ("load", ["--duration", "-5"], "argument --duration: -5 is not above 0"),
    ("chaos", ["--instances", "0"], "argument --instances: 0 is below 1"),
    ("chaos", ["--faults", "freeze,sigterm"],
     "argument --faults: unknown sigterm (of instance,leader,transfer,freeze,etcd,drain)"),
    ("transfer_chaos", ["--workers", "0"], "argument --workers: 0 is below 1"),
]


@pytest.mark.parametrize(("name", "flags", "message"), CASES, ids=[f"{n}{' '.join(f)}" for n, f, _ in CASES])
def test_a_flag_it_cannot_run_with_is_a_usage_error(name, flags, message, monkeypatch, capsys):
    parser = built_parser(ROOT / "benchmarks" / f"{name}.py", monkeypatch)
    with pytest.raises(SystemExit) as exited:
        PARSE(parser, flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["engine", "serving", "pd_compare", "prefill_chunks", "block_checksum", "chaos",
                                  "policy_sim"])
def test_the_defaults_pass(name, monkeypatch):
    PARSE(built_parser(ROOT / "benchmarks" / f"{name}.py", monkeypatch), [])
