"""Chaos for a while: a seeded streaming workload for --duration seconds while instances, the
leader manager and the transfer service are SIGKILLed and restarted at random (seeded)
points, with live migration on (tests/e2e/chaos.py; tests/e2e/test_chaos.py is the short form).
--faults picks other fault kinds: freeze (SIGSTOP one process of the cluster for 0.5-8 s),
etcd (SIGKILL etcd, restart it on its data dir), drain (admin Drain, then Undrain); --pd P:D
runs them on prefill and decode instances.

Prints one line, e.g.

    requests=812 lost=0 duplicated=0 corrupted=0 resumes=57 migrations=140 killed_instance=9 ...

and exits 1 unless lost, duplicated and corrupted are all 0, every drain ended with its instance
empty, and the survivors' KV blocks are all free again at the end.

    python benchmarks/chaos.py --duration 600 --seed 3
    python benchmarks/chaos.py --duration 240 --seed 5 --transfer-backend gloo --state-dir /tmp/chaos-gloo
    python benchmarks/chaos.py --duration 600 --seed 9 --faults instance,leader,transfer,freeze,etcd,drain
    python benchmarks/chaos.py --duration 300 --seed 9 --pd 1:2 --faults freeze,etcd,drain

With --state-dir the cluster's state, each service's log (logs/<name>.log) among it, stays
there after the run; without it, it goes with a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import signal
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.flags import HelpFormatter, above_zero, at_least, names_of, prefill_decode  # noqa: E402
from benchmarks.stopping import as_ctrl_c  # noqa: E402
from services.instance.models.tiny import build_tiny_model  # noqa: E402
from tests.e2e.chaos import ALL_FAULT_KINDS, FAULT_KINDS, ChaosConfig, ChaosRun  # noqa: E402
from tests.e2e.fault_cluster import FaultCluster, Reference  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=above_zero, default=300.0, help="seconds the workload keeps sending requests")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the faults")
    parser.add_argument("--instances", type=at_least(1), default=3, help="instances (2 managers, 1 transfer service)")
    parser.add_argument("--pd", type=prefill_decode, default=None,
                        help="P:D — P prefill and D decode instances instead of --instances")
    parser.add_argument("--concurrency", type=at_least(1), default=8, help="requests in flight at once")
    parser.add_argument("--model", type=pathlib.Path, default=None, help="model folder (default: a tiny random model)")
    parser.add_argument("--transfer-backend", default="grpc", choices=["grpc", "gloo", "shm"],
                        help="every instance's --transfer-backend (the transfer service's default backend too)")
    parser.add_argument("--faults", type=names_of(ALL_FAULT_KINDS), default=",".join(FAULT_KINDS),
                        help="comma-separated fault kinds, thrown in seeded rounds of each once")
    parser.add_argument("--state-dir", type=pathlib.Path, default=None,
                        help="keep the cluster's state and service logs here (default: a temporary folder)")
    return parser.parse_args()


def chaos_cluster(args: argparse.Namespace, model: pathlib.Path, state_dir: pathlib.Path) -> FaultCluster:
    roles: tuple[str, ...] = ()
    if args.pd:
        num_prefill, num_decode = (int(n) for n in args.pd.split(":"))
        roles = ("prefill",) * num_prefill + ("decode",) * num_decode
    return FaultCluster(model, state_dir, num_instances=args.instances, transfer_backend=args.transfer_backend,
                        roles=roles)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    config = ChaosConfig(seed=args.seed, duration_s=args.duration, concurrency=args.concurrency,
                         fault_kinds=tuple(dict.fromkeys(args.faults.split(","))))
    with tempfile.TemporaryDirectory(prefix="ferry-chaos-") as tmp:
        model = args.model or build_tiny_model(pathlib.Path(tmp) / "tiny", "gqa-tied", seed=0)
        reference = Reference(model)
        try:
            with chaos_cluster(args, model, args.state_dir or pathlib.Path(tmp) / "state").running() as cluster:
                result = asyncio.run(ChaosRun(cluster, reference, config).run())
        finally:
            reference.close()
    print(result.line())
    for failure in result.failures[:20]:
        print(failure, file=sys.stderr)
    sys.exit(0 if result.is_ok else 1)


if __name__ == "__main__":
    main()
