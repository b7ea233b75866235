"""The ``twisternet`` command: ``run``, ``master``, ``worker`` and the tools of other packages.

``twisternet run -n N script.py`` launches a whole job on this machine; on a plain cluster start
``twisternet master --world N`` on one host and ``twisternet worker --master HOST:PORT script.py`` on
each node; ``twisternet token [--file F]`` prints (or writes, mode 0600) a fresh job token.
``switch``, ``coflow-sim``, ``coflow-gen`` and ``bench`` hand their arguments to the modules that
implement them, imported only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from pathlib import Path
from collections.abc import Callable, Sequence

from .errors import TwisternetError
from .tokens import check_token, check_token_file, new_token

__all__ = ["main", "read_or_create_token"]

log = logging.getLogger(__name__)

#: Sub-commands implemented elsewhere: name -> ("module:function", what it is).
DELEGATES: dict[str, tuple[str, str]] = {
    "switch": ("innet.switch_server:main", "the in-network aggregation (ATP) software switch"),
    "ps": ("innet.ps:main", "a standing ATP parameter server (jobs placed with innet_ps)"),
    "coflow-sim": ("twisternet.coflow.cli:main", "the trace-driven coflow scheduling simulator"),
    "coflow-gen": ("twisternet.coflow.cli:gen_main", "the coflow trace generator"),
    "bench": ("benchmarks.__main__:main", "the benchmarks"),
    "testbed": ("twisternet.testbed.cli:main", "an emulated cluster of namespaced hosts (up/status/run/job/down)"),
}


#: Seconds ``twisternet master`` keeps refusing late joiners (with the reason) after the job failed to
#: start, before it exits.
MASTER_FAIL_LINGER = 2.0


def _fail(message: str, code: int = 2) -> int:
    sys.stderr.write(f"twisternet: error: {message}\n")
    sys.stderr.flush()
    return code


def read_or_create_token(path: str | os.PathLike[str]) -> tuple[str, bool]:
    """Read the job token from ``path``, or create the file (mode 0600) with a fresh random token.

    Returns (token, created). Raises TwisternetError if the file is unreadable, WeakTokenError if other
    users may read or write it or the token in it is too weak (see :mod:`twisternet.tokens`).
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            token = p.read_text().strip()
        except OSError as e:
            raise TwisternetError(f"cannot read token file {p}: {e}") from None
        check_token_file(p)
        return check_token(token, f"token file {p}"), False
    except OSError as e:
        raise TwisternetError(f"cannot create token file {p}: {e}") from None
    token = new_token()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def _token(token_file: str | None, *, create: bool) -> str:
    if token_file:
        if not create and not Path(token_file).exists():
            raise TwisternetError(f"token file {token_file} does not exist (the master creates it)")
        token, created = read_or_create_token(token_file)
        if created:
            sys.stderr.write(f"twisternet: wrote a new job token to {token_file} (mode 0600); "
                             "give the workers the same file\n")
        return token
    env_token = os.environ.get("TWISTERNET_TOKEN")
    if not env_token:
        raise TwisternetError("no job token: pass --token-file FILE or set TWISTERNET_TOKEN")
    return check_token(env_token, "TWISTERNET_TOKEN")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twisternet", description="Dataflow collectives over TCP or MPI.",
        epilog="Other commands: " + "; ".join(f"{k} ({v[1]})" for k, v in DELEGATES.items()))
    parser.add_argument("--log-level", default=None,
                        help="logging level of the twisternet loggers (default: $TWISTERNET_LOG_LEVEL "
                             "or WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run N workers of a script on this machine")
    run.add_argument("-n", "--np", dest="n", type=_positive_int, required=True, help="number of workers")
    run.add_argument("--grace", type=float, default=10.0,
                     help="seconds the others get to exit after a worker failed (default 10)")
    run.add_argument("--host", default="127.0.0.1", help="address the master binds (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=0, help="port the master binds (default: any free)")
    run.add_argument("--env", type=_key_value, action="append", default=[], metavar="K=V",
                     help="extra environment variable for the workers (repeatable)")
    run.add_argument("--innet", action="store_true",
                     help="start an in-network aggregation (ATP) switch beside the job for "
                          "AllReduce(via='innet') (needs the innet extra)")
    run.add_argument("script", help="Python script each worker runs")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    master = sub.add_parser("master", help="run the bootstrap master of a cluster job (foreground)",
                            description="Run the bootstrap master of a cluster job. Exits 0 once every "
                                        "worker left cleanly, 1 if one was lost, or if not every worker "
                                        "joined within connect_timeout (it then tells the ones that did "
                                        "who joined from which hosts and whom it refused, and why).")
    master.add_argument("--world", type=_positive_int, required=True, help="number of workers")
    master.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    master.add_argument("--port", type=int, default=0, help="port to bind (default: any free, printed)")
    master.add_argument("--token-file", default=None,
                        help="job token file; created with a fresh token (mode 0600) if missing. "
                             "Default: $TWISTERNET_TOKEN")

    worker = sub.add_parser("worker", help="run one worker of a cluster job")
    worker.add_argument("--master", default=None, help="HOST:PORT of the master (default $TWISTERNET_MASTER)")
    worker.add_argument("--token-file", default=None, help="job token file (default $TWISTERNET_TOKEN)")
    worker.add_argument("--rank", type=int, default=None, help="rank to request (default: any)")
    worker.add_argument("--world", type=_positive_int, default=None, help="expected number of workers")
    worker.add_argument("script", help="Python script to run")
    worker.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    tok = sub.add_parser("token", help="print a fresh random job token (or write it to a private file)")
    tok.add_argument("--file", default=None,
                     help="write the token to this new file (mode 0600) instead of printing it")

    for name, (_, what) in DELEGATES.items():
        sub.add_parser(name, help=what, add_help=False)
    return parser


def _setup_logging(level: str | None) -> None:
    level = level or os.environ.get("TWISTERNET_LOG_LEVEL") or "WARNING"
    logging.basicConfig(level=level.upper(), format="twisternet %(levelname)s %(name)s: %(message)s")


def _delegate(name: str, argv: list[str]) -> int:
    target, what = DELEGATES[name]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return _fail(f"'twisternet {name}' needs {module_name} ({what}), which is not installed "
                         "in this version", 1)
        raise
    fn: Callable[[list[str]], int | None] | None = getattr(module, attr, None)
    if fn is None:
        return _fail(f"{module_name} has no {attr}() entry point for 'twisternet {name}'", 1)
    result = fn(argv)
    return int(result or 0)


def _cmd_run(ns: argparse.Namespace) -> int:
    from .launcher import run
    if not Path(ns.script).is_file():
        return _fail(f"no such script: {ns.script}")
    env = dict(ns.env)
    if ns.log_level and "TWISTERNET_LOG_LEVEL" not in env:
        env["TWISTERNET_LOG_LEVEL"] = ns.log_level  # the workers log like the launcher
    from .errors import LaunchError
    try:
        return run(ns.n, ns.script, ns.args, grace=ns.grace, host=ns.host, port=ns.port, env=env,
                   innet=ns.innet)
    except LaunchError as e:
        return _fail(str(e), 1)


def _cmd_master(ns: argparse.Namespace) -> int:
    from .bootstrap import Master, install_job_services
    from .config import load_config
    token = _token(ns.token_file, create=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TWISTERNET_TOKEN", "TWISTERNET_MASTER", "TWISTERNET_RANK", "TWISTERNET_WORLD")}
    config = load_config(env=env)
    # The workers give up joining after connect_timeout; so does the master, telling the ones that
    # joined why (who is missing, who was refused), then exits after a short linger for late joiners.
    master = Master(ns.world, token.encode(), ns.host, ns.port, handshake_timeout=config.handshake_timeout,
                    peer_timeout=config.peer_timeout, heartbeat_interval=config.heartbeat_interval,
                    join_timeout=config.connect_timeout, fail_linger=MASTER_FAIL_LINGER)
    install_job_services(master)
    host, port = master.address
    sys.stderr.write(f"twisternet: master for {ns.world} workers listening on {host}:{port}\n")
    sys.stderr.flush()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        code = master.serve_forever()
        if master.failure is not None:
            return _fail(master.failure, code or 1)
        return code
    except KeyboardInterrupt:
        sys.stderr.write("twisternet: master interrupted; workers were told it shut down\n")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cmd_worker(ns: argparse.Namespace) -> int:
    from .bootstrap import parse_address
    master = ns.master or os.environ.get("TWISTERNET_MASTER")
    if not master:
        return _fail("no master address: pass --master HOST:PORT or set TWISTERNET_MASTER")
    try:
        parse_address(master)
    except ValueError as e:
        return _fail(str(e))
    if ns.rank is not None and (ns.rank < 0 or (ns.world is not None and ns.rank >= ns.world)):
        return _fail(f"--rank must be in [0, world), got {ns.rank}")
    env = dict(os.environ)
    env["TWISTERNET_MASTER"] = master
    env["TWISTERNET_TOKEN"] = _token(ns.token_file, create=False)
    for key, value in (("TWISTERNET_RANK", ns.rank), ("TWISTERNET_WORLD", ns.world)):
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    if not Path(ns.script).is_file():
        return _fail(f"no such script: {ns.script}")
    argv = [sys.executable, ns.script, *ns.args]
    sys.stdout.flush()
    sys.stderr.flush()
    # Become the script: its exit status is ours, and signals reach it directly.
    os.execve(sys.executable, argv, env)
    return 127  # pragma: no cover - execve does not return


def _cmd_token(ns: argparse.Namespace) -> int:
    if ns.file is None:
        sys.stdout.write(new_token() + "\n")
        return 0
    if Path(ns.file).exists():
        return _fail(f"{ns.file} exists already; not overwriting a token file", 1)
    read_or_create_token(ns.file)
    sys.stderr.write(f"twisternet: wrote a new job token to {ns.file} (mode 0600)\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``twisternet`` console script; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Delegated commands take their arguments verbatim (their own parsers handle --help etc.).
    i = 0
    while i < len(args) and args[i].startswith("--log-level"):
        i += 1 if "=" in args[i] else 2
    if i < len(args) and args[i] in DELEGATES:
        ns, _ = _parser().parse_known_args(args[:i])
        _setup_logging(ns.log_level)
        try:
            return _delegate(args[i], args[i + 1:])
        except TwisternetError as e:
            return _fail(str(e), 1)
    parser = _parser()
    ns = parser.parse_args(args)
    _setup_logging(ns.log_level)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if ns.command == "run":
            return _cmd_run(ns)
        if ns.command == "master":
            return _cmd_master(ns)
        if ns.command == "worker":
            return _cmd_worker(ns)
        if ns.command == "token":
            return _cmd_token(ns)
    except TwisternetError as e:
        return _fail(str(e), 1)
    except OSError as e:
        return _fail(str(e), 1)
    return _fail(f"unknown command {ns.command!r}")
