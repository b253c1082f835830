"""`up --frontend-arg`: flags passed on to the frontend, checked before anything starts. Before, `up` had
no way to give its frontend a flag (only FERRY_FRONTEND_* variables reached it), e.g. --api-key or
--generation-config (a review)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from services.cluster.__main__ import parse_args
from services.cluster.launcher import LocalCluster
from tests.unit.cluster.test_launcher_args import usage_error
from tests.unit.cluster.test_ports import spec

pytestmark = pytest.mark.timeout(30)


def test_each_value_is_split_into_words_as_a_shell_would():
    args = parse_args(["up", "--frontend-arg=--api-key K1", "--frontend-arg", "--generation-config vllm",
                       "--frontend-arg=--override-generation-config='{\"temperature\": 0.5}'",
                       "--frontend-arg=--api-key=K2"])
    assert args.frontend_arg == ("--api-key", "K1", "--generation-config", "vllm",
                                   "--override-generation-config={\"temperature\": 0.5}", "--api-key=K2")
    assert parse_args(["up"]).frontend_arg == ()


def test_the_frontend_gets_them_after_the_launcher_s_flags():
    words = ("--max-inflight", "8", "--generation-config=vllm")
    cluster = LocalCluster(dataclasses.replace(spec(18000, 18001), frontend_args=words))
    cluster.etcd = types.SimpleNamespace(endpoint="127.0.0.1:2379")
    args = cluster._frontend().args
    assert tuple(args[-len(words):]) == words and args[args.index("--port") + 1] == "18000"


@pytest.mark.parametrize("value, named", [
    ("--bogus 1", "unrecognized arguments: --bogus 1"),
    ("--max-inflight=0", "--max-inflight must be positive, got 0"),
    ("--override-generation-config={x", "--override-generation-config: not valid JSON"),
    ("--generate-timeout-s soon", "--generate-timeout-s: expected float, got 'soon'"),
])
def test_a_bad_flag_or_value_is_a_usage_error_of_up_naming_it(value, named, capsys):
    err = usage_error([f"--frontend-arg={value}"], capsys)
    assert err.startswith("python -m services.cluster up --frontend-arg: error: ") and named in err, err
    assert err.count("\n") == 1, err  # one line, no usage dump


@pytest.mark.parametrize("value, instead", [
    ("--port 9000", "--port is set by the launcher; use up's --http-port"),
    ("--po=9000", "--port is set by the launcher; use up's --http-port"),  # argparse takes abbreviations
    ("--host 0.0.0.0", "--host is set by the launcher; use up's --http-host"),
    ("--model /m", "--model is set by the launcher; use up's --model"),
    ("--etcd-endpoints h:1", "--etcd-endpoints is set by the launcher\n"),
    ("--cluster-token t", "--cluster-token is set by the launcher; use up's --cluster-token-file"),
])
def test_a_flag_the_launcher_sets_is_refused_naming_up_s_flag(value, instead, capsys):
    err = usage_error([f"--frontend-arg={value}"], capsys)
    assert err.startswith("python -m services.cluster up: error: --frontend-arg: ") and instead in err, err


def test_a_value_a_shell_could_not_split_is_a_usage_error(capsys):
    assert "--frontend-arg \"--api-key 'K1\": No closing quotation" in usage_error(["--frontend-arg=--api-key 'K1"],
                                                                                    capsys)
