"""Migration downtime vs sequence length: live multi-stage, stop-and-copy, and recompute.

Two real instance processes (A, B), each with its own transfer service, on loopback; a
tiny long-context model (`long-context` tiny shape: 8192+ positions, 4 KiB of float32 KV
a token, so copying a whole 8192-token cache — 32 MiB — shows). For each sequence length
one greedy request is prefilled on A and decodes a few tokens; then, in turn:

* live:       A → B, multi-stage (--stage-blocks, --max-stages): full blocks copied while
              the request decodes, then a pause and a copy of the last few blocks;
* stop-copy:  B → A with max_stages 0: pause first, copy every block, commit;
* recompute:  abort on A, re-prefill prompt + generated tokens on B (what failover does).

Prefix caching is off on both instances: with it, stop-copy back to A and the recompute on
B would find the request's own blocks still cached there and skip most of their work.

Downtime = last token streamed from the source → first token streamed from the
destination, timed by the client (the pause happens at the step boundary right after the
source's last token, so this is "paused → first token on the destination", plus one
stream hop; it contains one decode step of the destination). The decode step is the
mean inter-token time on the source just before (its last 10 tokens). The instance's own figure
(suspended → committed, from MigrateOut) is shown next to it. Target for live: flat
(at the longest length ≤ 1.5× the shortest) and below one decode step + 20 ms.

    PYTHONPATH=. .venv/bin/python benchmarks/migration_downtime.py [--quick]

The decode step of the tiny model grows with the context (CPU attention), so the
"live_minus_step_ms" column — what the migration adds to a normal token — shows the
flatness of the migration itself.

Prints a table and writes migration_downtime.tsv and migration_downtime.png to --out-dir. The
services' logs go to a temporary folder, removed after a run that succeeded (--keep-logs keeps
it) and kept, and named, after one that failed.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere, as the README shows
from services.cluster.processes import ServiceProcess  # noqa: E402
from services.common.etcd_launcher import free_port  # noqa: E402
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc  # noqa: E402
from benchmarks.stopping import as_ctrl_c, logs_kept_on_failure  # noqa: E402
from benchmarks.flags import HelpFormatter  # noqa: E402

MODES = ("live", "stop_copy", "recompute")
TINY_SHAPE = "long-context"
TOKENS_BEFORE = 10  # decoded on the source before each move (the last ones time the decode step)
TOKENS_AFTER = 3  # decoded on the destination after each move
MAX_STEP_WINDOWS = 5  # windows of TOKENS_BEFORE tokens tried for one decode-step figure
MIN_STEP_MS = 0.1  # a median inter-token time below this is tokens read in a burst, not decode steps
MAX_OUTPUT_TOKENS = 4000  # never reached: each request is aborted once measured (a slow, loaded run must not finish it first)
MIN_LENGTH = TOKENS_BEFORE + 3  # a prompt of one token at least
MIN_OUTPUT_ROOM = 128  # tokens left to decode at the longest length: 2 + 5 step windows of 10, 3 + 3 + 1 after the moves, and what decodes during the live stages
RPC_TIMEOUT_S = 120.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192", help="sequence lengths in tokens")
    parser.add_argument("--repeats", type=int, default=2, help="requests per length (the median counts)")
    parser.add_argument("--quick", action="store_true", help="lengths 256,8192 and one repeat")
    parser.add_argument("--model", type=pathlib.Path, default=None,
                        help=f"model folder (default: the tiny {TINY_SHAPE!r} shape, built in a temp folder)")
    parser.add_argument("--backend", default="grpc", choices=("grpc", "gloo", "shm", "auto"),
                        help="the instances' --transfer-backend; with shm or auto both instances share one transfer "
                             "service (one host), so every copy is a shared-memory copy")
    parser.add_argument("--stage-blocks", type=int, default=16, help="instances' --migration-stage-blocks")
    parser.add_argument("--max-stages", type=int, default=3, help="instances' --migration-max-stages")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument("--log-level", default="warning", help="the services' --log-level")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the services' logs (and the tiny model) after a run that succeeded and print "
                             "their folder (a failed run always keeps them and names it)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("bench-results"),
                        help="where the TSV and PNG are written")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = "256,8192", 1
    try:
        args.lengths = [int(length) for length in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths {args.lengths}: comma-separated token counts, e.g. 256,8192")
    if problem := flag_problem(args):
        parser.error(problem)
    return args


def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags the benchmark itself uses (the services check theirs), or None."""
    if (shortest := min(args.lengths)) < MIN_LENGTH:
        return f"--lengths: {shortest} is too short; each length is at least {MIN_LENGTH} tokens"
    if args.repeats < 1:
        return f"--repeats {args.repeats}: at least 1"
    return None


# -- the processes ------------------------------------------------------------------------

def serving_length(lengths: list[int], model_dir: pathlib.Path) -> int:
    """The instances' --max-model-len: room for every request to go on decoding until it is measured
    (capped by the model's context, which must leave MIN_OUTPUT_ROOM tokens at the longest length)."""
    from services.instance.engine.model_config import ModelConfig  # here: torch, 2 s of CPU, only once flags are good

    context = ModelConfig.from_dir(model_dir).context_length
    if context - max(lengths) < MIN_OUTPUT_ROOM:
        raise SystemExit(f"--lengths: the model serves {context} tokens; the longest length may be "
                         f"{context - MIN_OUTPUT_ROOM}, leaving {MIN_OUTPUT_ROOM} to decode")
    return min(context, max(lengths) + MAX_OUTPUT_TOKENS + 64)


class Pair:
    """Instances A and B, each with its co-located transfer service (one shared by both for shm and
    auto, as on one host), and open stubs to both."""

    def __init__(self, args: argparse.Namespace, model_dir: pathlib.Path, log_dir: pathlib.Path) -> None:
        self.max_model_len = serving_length(args.lengths, model_dir)
        num_blocks = 2 * (self.max_model_len // args.block_size + 8)  # a migrating request may hold two sets briefly
        transfer_of = {"a": "ab", "b": "ab"} if args.backend in ("shm", "auto") else {"a": "a", "b": "b"}
        self.transfers = {name: _transfer(f"t{name}", args, log_dir) for name in dict.fromkeys(transfer_of.values())}
        self.instances = {name: _instance(name, self.transfers[transfer].address, args, model_dir, self.max_model_len,
                                          num_blocks, log_dir) for name, transfer in transfer_of.items()}
        self.stubs: dict[str, instance_pb2_grpc.InstanceServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def start(self) -> None:
        for process in self.transfers.values():
            process.start()
        for process in self.transfers.values():
            await process.wait_healthy(60)
        for process in self.instances.values():
            process.start()
        for process in self.instances.values():
            await process.wait_healthy(120)
        for name, process in self.instances.items():
            self._channels.append(grpc.aio.insecure_channel(process.address))
            self.stubs[name] = instance_pb2_grpc.InstanceServiceStub(self._channels[-1])

    def address(self, name: str) -> str:
        return self.instances[name].address

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        for process in [*self.instances.values(), *self.transfers.values()]:
            process.signal(signal.SIGCONT)
            process.stop()


def _transfer(name: str, args: argparse.Namespace, log_dir: pathlib.Path) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(name, "transfer", ["--port", str(port), "--transfer-id", name, "--num-threads", "1",
                                             "--log-level", args.log_level], f"127.0.0.1:{port}", log_dir)


def _instance(name: str, transfer_address: str, args: argparse.Namespace, model_dir: pathlib.Path,
              max_model_len: int, num_blocks: int, log_dir: pathlib.Path) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(name, "instance", [
        "--model", str(model_dir), "--port", str(port), "--instance-id", name, "--num-threads", str(args.threads),
        "--num-blocks", str(num_blocks), "--block-size", str(args.block_size), "--max-model-len", str(max_model_len),
        "--transfer-address", transfer_address, "--transfer-backend", args.backend,
        "--migration-stage-blocks", str(args.stage_blocks), "--migration-max-stages", str(args.max_stages),
        "--enable-prefix-caching", "false",  # every mode moves or recomputes the whole request
        "--log-level", args.log_level], f"127.0.0.1:{port}", log_dir)


# -- one request, followed across hand-offs ----------------------------------------------

@dataclass
class Trace:
    """Every token the client saw: its index, arrival time and the instance that streamed it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for(self, num_tokens: int) -> None:
        await self._wait_until(lambda: len(self.token_ids) >= num_tokens)

    async def wait_from(self, owner: str, num_tokens: int) -> None:
        """Until the last `num_tokens` tokens came from `owner` (tokens the previous owner streamed
        before its hand-off may still be arriving: they do not count)."""
        await self._wait_until(lambda: self.owners[-num_tokens:] == [owner] * num_tokens)

    async def _wait_until(self, is_done: Callable[[], bool]) -> None:
        while not is_done():
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), RPC_TIMEOUT_S)

    def add(self, chunk: instance_pb2.GenerateChunk, owner: str) -> None:
        if chunk.token_ids and chunk.token_index != len(self.token_ids):
            raise AssertionError(f"{self.request_id}: token index {chunk.token_index} after {len(self.token_ids)} "
                                 "tokens: a gap or a duplicate across the hand-off")
        now = time.perf_counter()
        for token_id in chunk.token_ids:
            self.token_ids.append(token_id)
            self.times.append(now)
            self.owners.append(owner)
        self.arrived.set()

    def step_ms(self, last: int) -> float:
        """Mean inter-token time over the `last` intervals (a mean: tokens read in bursts still count right)."""
        return (self.times[-1] - self.times[-last - 1]) / last * 1e3

    async def decode_step_ms(self, num_tokens: int) -> float | None:
        """Mean inter-token time over the next `num_tokens` tokens, or None. A client that fell behind
        (a busy machine) reads tokens in bursts, which time nothing: such a window is measured again."""
        for _ in range(MAX_STEP_WINDOWS):
            await self.wait_for(len(self.token_ids) + num_tokens)
            intervals = [b - a for a, b in zip(self.times[-num_tokens:], self.times[-num_tokens + 1:])]
            if statistics.median(intervals) * 1e3 >= MIN_STEP_MS:
                return self.step_ms(num_tokens - 1)
        return None

    def gap_ms(self, src: str, dst: str) -> float:
        """Last token from `src` → the first from `dst` after it."""
        for i in range(len(self.owners) - 1, 0, -1):
            if self.owners[i] == dst and self.owners[i - 1] == src:
                return (self.times[i] - self.times[i - 1]) * 1e3
        raise AssertionError(f"{self.request_id}: no hand-off {src} → {dst} in the trace")


async def follow(pair: Pair, trace: Trace, call, owner: str) -> None:
    """Read the stream to its end, attaching (on the already open channel) after each hand-off."""
    while True:
        async for chunk in call:
            if chunk.HasField("handoff"):
                owner = chunk.handoff.dst_instance_id
                call = pair.stubs[owner].Attach(instance_pb2.AttachRequest(
                    request_id=trace.request_id, from_token_index=chunk.handoff.next_token_index,
                    epoch=chunk.handoff.epoch), timeout=RPC_TIMEOUT_S)
                break
            trace.add(chunk, owner)
        else:
            return


def generate(stub, request_id: str, prompt: list[int], max_tokens: int):
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return stub.Generate(instance_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                                      sampling=sampling), timeout=RPC_TIMEOUT_S)


async def migrate(pair: Pair, request_id: str, src: str, dst: str, max_stages: int | None = None):
    request = instance_pb2.MigrateOutRequest(request_id=request_id, dst_instance_id=dst, dst_address=pair.address(dst))
    if max_stages is not None:
        request.max_stages = max_stages
    return await pair.stubs[src].MigrateOut(request, timeout=RPC_TIMEOUT_S)


# -- the three ways to move a request ------------------------------------------------------

@dataclass
class Sample:
    length: int
    step_ms: float  # decode step on the source just before the live migration
    downtime_ms: dict[str, float]  # by mode, client side
    instance_ms: dict[str, float]  # suspended → committed, from MigrateOut (live, stop_copy)


async def measure_one(pair: Pair, length: int, index: int, rng: random.Random) -> Sample:
    request_id = f"len{length}-{index}"
    prompt = [rng.randrange(10, 500) for _ in range(length - TOKENS_BEFORE - 2)]  # `length` tokens when it moves
    trace = Trace(request_id)
    max_tokens = min(MAX_OUTPUT_TOKENS, pair.max_model_len - len(prompt))
    reader = asyncio.create_task(follow(pair, trace, generate(pair.stubs["a"], request_id, prompt, max_tokens), "a"))
    try:
        await trace.wait_for(2)  # past the prefill
        step_ms = await trace.decode_step_ms(TOKENS_BEFORE) or await instance_step_ms(pair, "a")
        live = await migrate(pair, request_id, "a", "b")
        await trace.wait_from("b", TOKENS_AFTER)
        stop_copy = await migrate(pair, request_id, "b", "a", max_stages=0)
        await trace.wait_from("a", TOKENS_AFTER)
        recompute_ms = await recompute(pair, trace, prompt, "a", "b")
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        for stub in pair.stubs.values():
            await abort_if_there(stub, request_id)
    return Sample(length, step_ms, {"live": trace.gap_ms("a", "b"), "stop_copy": trace.gap_ms("b", "a"),
                                    "recompute": recompute_ms},
                  {"live": live.downtime_ms, "stop_copy": stop_copy.downtime_ms})


async def instance_step_ms(pair: Pair, name: str) -> float:
    """The instance's median step over its recent steps: what a client too busy to time tokens falls back on."""
    status = await pair.stubs[name].GetStatus(instance_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT_S)
    return status.load.step_time_ms_p50


async def abort_if_there(stub, request_id: str) -> None:
    try:
        await stub.Abort(instance_pb2.AbortRequest(request_id=request_id), timeout=10)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise


async def recompute(pair: Pair, trace: Trace, prompt: list[int], src: str, dst: str) -> float:
    """At the next token from `src`: abort there, re-prefill prompt + output on `dst`; → ms to its first token."""
    await trace.wait_for(len(trace.token_ids) + 1)
    paused_at, output = trace.times[-1], list(trace.token_ids)
    await pair.stubs[src].Abort(instance_pb2.AbortRequest(request_id=trace.request_id), timeout=10)
    call = generate(pair.stubs[dst], f"{trace.request_id}-re", prompt + output, 1)
    async for chunk in call:
        if chunk.token_ids:
            call.cancel()
            return (time.perf_counter() - paused_at) * 1e3
    raise AssertionError(f"{trace.request_id}: the recomputed request streamed no token")


async def warm_up(pair: Pair, rng: random.Random) -> None:
    """One move of each kind, so channels (instance ↔ instance, transfer ↔ transfer) are open."""
    await measure_one(pair, 64, 0, rng)


# -- the run ---------------------------------------------------------------------------------

async def run(args: argparse.Namespace, model_dir: pathlib.Path, log_dir: pathlib.Path) -> list[Sample]:
    pair = Pair(args, model_dir, log_dir)
    rng = random.Random(args.seed)
    samples = []
    try:
        await pair.start()
        await warm_up(pair, rng)
        with tqdm(total=len(args.lengths) * args.repeats, desc="migration_downtime", unit="request") as progress:
            for length in args.lengths:
                for index in range(args.repeats):
                    samples.append(await measure_one(pair, length, index, rng))
                    progress.update()
    finally:
        await pair.close()
    return samples


@dataclass(frozen=True, slots=True)
class Row:
    length: int
    step_ms: float
    downtime_ms: dict[str, float]
    instance_ms: dict[str, float]


def rows_of(samples: list[Sample], lengths: list[int]) -> list[Row]:
    rows = []
    for length in lengths:
        mine = [s for s in samples if s.length == length]
        rows.append(Row(length, statistics.median(s.step_ms for s in mine),
                        {m: statistics.median(s.downtime_ms[m] for s in mine) for m in MODES},
                        {m: statistics.median(s.instance_ms[m] for s in mine) for m in ("live", "stop_copy")}))
    return rows


def report(rows: list[Row], out_dir: pathlib.Path) -> str:
    header = ["seq_len", "decode_step_ms", *(f"{m}_downtime_ms" for m in MODES), "live_minus_step_ms",
              "live_suspend_commit_ms", "stop_copy_suspend_commit_ms"]
    lines = ["\t".join(header)]
    for row in rows:
        figures = [row.step_ms, *(row.downtime_ms[m] for m in MODES), row.downtime_ms["live"] - row.step_ms,
                   *row.instance_ms.values()]
        lines.append("\t".join([str(row.length), *(f"{value:.1f}" for value in figures)]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "migration_downtime.tsv").write_text("\n".join(lines) + "\n")
    first, last = rows[0], rows[-1]
    ratio = last.downtime_ms["live"] / first.downtime_ms["live"]
    bound = last.step_ms + 20.0
    lines += ["", f"live downtime at {last.length} tokens / at {first.length} tokens: {ratio:.2f} (target <= 1.5: "
                  f"{'met' if ratio <= 1.5 else 'MISSED'})",
              f"live downtime at {last.length} tokens: {last.downtime_ms['live']:.1f} ms vs one decode step + 20 ms "
              f"= {bound:.1f} ms ({'met' if last.downtime_ms['live'] <= bound else 'MISSED'})",
              f"decode step at {last.length} tokens / at {first.length} tokens: {last.step_ms / first.step_ms:.2f} "
              "(the destination's first step is part of every downtime)"]
    return "\n".join(lines)


def plot(rows: list[Row], out_dir: pathlib.Path) -> pathlib.Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [row.length for row in rows]
    figure, axes = plt.subplots(figsize=(8, 5))
    for mode in MODES:
        axes.plot(lengths, [row.downtime_ms[mode] for row in rows], marker="o", label=mode.replace("_", "-"))
    axes.plot(lengths, [row.step_ms + 20 for row in rows], "--", color="grey", label="decode step + 20 ms")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(lengths, [str(length) for length in lengths])
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel("downtime (ms): last token on source → first on destination")
    axes.set_title("ferry migration downtime (tiny long-context model, loopback)")
    axes.grid(True, alpha=0.3, which="both")
    axes.legend()
    path = out_dir / "migration_downtime.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    work_dir = pathlib.Path(tempfile.mkdtemp(prefix="ferry-downtime-"))  # the tiny model and logs/
    from services.instance.models.tiny import build_tiny_model  # here, as ModelConfig in serving_length

    model_dir = args.model or build_tiny_model(work_dir / "model", TINY_SHAPE)
    try:
        serving_length(args.lengths, model_dir)  # --lengths longer than the model serves: refused before any start
    except SystemExit:
        shutil.rmtree(work_dir)
        raise
    with logs_kept_on_failure("migration_downtime", work_dir / "logs", work_dir, keep=args.keep_logs):
        samples = asyncio.run(run(args, model_dir, work_dir / "logs"))
    rows = rows_of(samples, args.lengths)
    print(report(rows, args.out_dir))
    print(f"plot: {plot(rows, args.out_dir)}")
    if args.keep_logs:
        print(f"logs: {work_dir / 'logs'}")


if __name__ == "__main__":
    main()
