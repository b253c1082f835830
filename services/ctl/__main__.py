"""`python -m services.ctl`: ferryctl, the admin API from a terminal.

    python -m services.ctl [--admin HOST:PORT[,HOST:PORT...]] [--token T] [--json] COMMAND ...

Global options may come before or after the command and can be set as FERRY_CTL_ADMIN,
FERRY_CTL_TOKEN, FERRY_CTL_JSON, FERRY_CTL_TIMEOUT_S. Exit status: 0 done, 1 the call
failed (the message says why), 2 usage error, 3 the manager does not implement the call
(it runs an older ferry). A caveat about an answer (`instances` from a manager that is not the leader
and has no load reports) is a line under the table, and on stderr with --json; the exit status is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from services.common.config import OneLineErrorParser, parse_config
from services.common.errors import FerryError, Unavailable
from services.ctl.client import ROLES, AdminClient, NotAvailableYet
from services.ctl.commands import COMMANDS
from services.ctl.config import CtlConfig
from services.ctl.manager_pick import admin_addresses, first_reachable
from services.ctl.records import to_json
from services.ctl.top import run_top

EXIT_FAILED, EXIT_USAGE, EXIT_NOT_AVAILABLE = 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    common = _global_options()
    parser = OneLineErrorParser(prog="ferryctl", parents=[common], description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, under: argparse._SubParsersAction = commands) -> argparse.ArgumentParser:
        return under.add_parser(name, parents=[common], help=summary, description=summary)

    command("instances", "instances with role, state and load")
    requests = command("requests", "requests on every instance (or one)")
    requests.add_argument("--instance", help="only this instance's requests")
    command("status", "leader, policy and cluster totals")
    policy = command("policy", "show (get, the default) or change (set) the dispatch and migration policy")
    actions = policy.add_subparsers(dest="action", required=False, metavar="ACTION")
    command("get", "show the policy", actions)
    policy_set = command("set", "change the policy (every manager follows)", actions)
    policy_set.add_argument("dispatch", nargs="?",
                            help="load | queue | balanced | round_robin | prefix | flood (the manager validates)")
    policy_set.add_argument("--set", action="append", metavar="FIELD=VALUE",
                            help="another policy field, e.g. --set migration_enabled=true --set migration_threshold=8")
    drain = command("drain", "stop sending new requests to an instance and migrate its running ones away "
                             "(--undo: take it back)")
    drain.add_argument("instance_id", help="the instance (`instances` lists them)")
    drain.add_argument("--undo", action="store_true",
                       help="delete the drain mark: new requests reach the instance again (AdminService/Undrain)")
    migrate = command("migrate", "live-migrate a running request, KV cache and all, to another instance "
                                 "(waits as long as the manager says its Migrate may take, from its "
                                 "--migration-timeout-s, + 5 s; 75 s for an older manager; or --timeout-s if longer)")
    migrate.add_argument("--request", help="request id (default: the manager picks one on --src)")
    migrate.add_argument("--src", help="source instance id (default: the request's instance, or with no --request "
                                       "the least free instance that has a request)")
    migrate.add_argument("--dst", help="destination instance id (default: the freest instance)")
    migrations = command("migrations", "the leader's recent migrations (committed, failed, refused, unknown)")
    migrations.add_argument("--instance", help="only migrations from or to this instance")
    migrations.add_argument("--request", help="only this request's migrations")
    role = command("role", "change an instance's prefill/decode role")
    role.add_argument("instance_id", help="the instance (`instances` lists them)")
    role.add_argument("role", choices=ROLES, help="both: serves whole requests; prefill: prompts, then hands "
                                                  "each request to a decode instance; decode: takes those")
    top = command("top", "live view of instances and load")
    top.add_argument("--interval-s", "--interval", dest="interval", type=_positive_seconds, default=1.0, metavar="S",
                     help="seconds between refreshes (default: 1)")
    top.add_argument("--iterations", type=_non_negative_int, default=0,
                     help="frames to draw, then exit (default: 0 = until Ctrl-C)")
    return parser


def _global_options() -> argparse.ArgumentParser:
    """CtlConfig's fields as flags that are only set when given (SUPPRESS), so they work before or after COMMAND."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML file with any of the options below (field names as keys) [env FERRY_CTL_CONFIG]")
    for field in dataclasses.fields(CtlConfig):
        flag = f"--{field.name.replace('_', '-')}"
        shown = "empty" if field.default == "" else field.default
        help_text = f"{field.metadata['help']} [env FERRY_CTL_{field.name.upper()}] (default: {shown})"
        if field.type in (bool, "bool"):
            common.add_argument(flag, dest=field.name, action="store_const", const="true", default=argparse.SUPPRESS,
                                help=help_text)
        else:
            common.add_argument(flag, dest=field.name, default=argparse.SUPPRESS, metavar=field.name.upper(),
                                help=help_text)
    return common


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):  # nan fails too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def resolve_config(args: argparse.Namespace) -> CtlConfig:
    """Flags given on the command line, then FERRY_CTL_* env, then --config file, then defaults."""
    argv: list[str] = []
    for name in ["config", *(f.name for f in dataclasses.fields(CtlConfig))]:
        if name in vars(args):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return parse_config(CtlConfig, "ctl", argv, prog="ferryctl")


async def execute(config: CtlConfig, args: argparse.Namespace) -> int:
    address = await first_reachable(admin_addresses(config.admin), config.tls, config.timeout_s)
    async with AdminClient(address, config.resolved_token, config.timeout_s, config.tls) as client:
        try:
            if args.command == "top":
                return 0 if await run_top(client, args.interval, args.iterations, config.json) else EXIT_FAILED
            record, text, *notes = await COMMANDS[args.command](client, args)
        except NotAvailableYet as exc:
            return _fail(config, exc, EXIT_NOT_AVAILABLE)
        except FerryError as exc:
            return _fail(config, exc, EXIT_FAILED, is_manager_reached=client.is_connected(), address=address)
        except ValueError as exc:  # a malformed argument the parser could not see
            print(f"ferryctl: {exc}", file=sys.stderr)
            return EXIT_USAGE
    print(json.dumps(to_json(record), indent=2) if config.json else text)
    for note in notes if config.json else ():  # the caveats the text carries, kept off the JSON scripts read
        print(f"ferryctl: {note}", file=sys.stderr)
    return 0


def _fail(config: CtlConfig, exc: FerryError, status: int, is_manager_reached: bool = True, address: str = "") -> int:
    """Print the error; where the manager itself could not be reached, say which one was tried.
    (An UNAVAILABLE the manager answered with is about something behind it, e.g. a transfer service.)"""
    message = exc.message
    if isinstance(exc, Unavailable) and not is_manager_reached:
        address = address or config.admin
        tried = f"--admin {address}" if len(admin_addresses(config.admin)) == 1 else f"{address} of --admin {config.admin}"
        message += f" (manager at {tried}; set --admin or FERRY_CTL_ADMIN to another manager"
        message += ("" if "Connection refused" in message else _tls_hint(config)) + ")"  # refused: nothing listens
    if config.json:
        print(json.dumps({"error": message, "code": type(exc).__name__}))
    print(f"ferryctl: {message}", file=sys.stderr)
    return status


def _tls_hint(config: CtlConfig) -> str:
    """What TLS setting may be missing when the manager could not be reached (a refused handshake says
    only "Socket closed"): under mutual TLS, ferryctl with --tls-ca alone was sent to another manager."""
    if not config.tls_ca:
        return "; if it serves TLS, pass --tls-ca and, for mutual TLS, --tls-cert and --tls-key"
    if not config.tls_cert:
        return "; if it requires client certificates (mutual TLS), pass --tls-cert and --tls-key"
    return "; if it requires client certificates, --tls-cert must be signed by the CA of its --tls-client-ca"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = resolve_config(args)
    try:
        return asyncio.run(execute(config, args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ferryctl ... | head -1`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
