"""The `cachegw` command line: one subcommand per job, each importing only what it needs."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from typing import TYPE_CHECKING

from cachegw.configtools.logs import FORMAT_ENV, FORMATS, LEVEL_ENV, LEVELS, env_choice, setup_logging

if TYPE_CHECKING:
    from cachegw.gateway.config import Settings


def _add_log_args(p: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, defaulting to CACHEGW_LOG_LEVEL / CACHEGW_LOG_FORMAT (which is how
    `cachegw serve` hands its choice to the built-in engine's process)."""
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=env_choice(LEVEL_ENV, LEVELS, "INFO"),
        help=f"least severe level logged (default INFO, or ${LEVEL_ENV})",
    )
    p.add_argument(
        "--log-format",
        type=str.lower,
        choices=FORMATS,
        default=env_choice(FORMAT_ENV, FORMATS, "text"),
        help="text lines, or JSON lines with ts, level, logger, message, request_id "
        f"(default text, or ${FORMAT_ENV})",
    )


def _version() -> str:
    try:
        return metadata.version("cachegw")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config file merged over the packaged config.toml")
    p.add_argument("--model", help="a .gguf file or a local Hugging Face folder (default: embedded SmolLM2)")
    p.add_argument("--host", help="address to listen on (default from config)")
    p.add_argument("--port", type=int, help="port to listen on (default from config)")
    p.add_argument(
        "--cpus", help="cores the engine may use, a CPU list such as 1 or 2-7 (default from config)"
    )
    p.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "int4"),
        help="weights: auto (the GGUF's own int4/int8 blocks; float for a float model), none (float), "
        "int8, int4 (default from config: auto)",
    )
    p.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        help="both (default from config) | prefill: computes prompts' KV for decode engines | decode: "
        "long prompts computed by --prefill-url, their KV read from the shared tier",
    )
    p.add_argument("--prefill-url", help='a decode engine\'s prefill engine, "http://host:port"')


def _cmd_backend(args: argparse.Namespace) -> int:
    from cachegw.backend.entrypoints.command import main

    roles = {"role": args.role, "prefill_url": args.prefill_url}
    main(args.config, args.host, args.port, args.model, args.cpus, args.quantization, **roles)
    return 0


def check_ports(settings: Settings) -> None:
    """A busy gateway port, or a busy port for the built-in engine, stops the start naming it."""
    from cachegw.gateway.upstream.supervisor import port_is_free

    g = settings.gateway
    wanted = [("gateway", g.host, g.port)]
    if g.metrics_port:
        wanted.append(("metrics ([gateway] metrics_port)", g.metrics_host, g.metrics_port))
    if not g.backends:
        port = settings.backend_server.port
        wanted.append(("built-in backend ([backend_server] port)", "127.0.0.1", port))
    for what, host, port in wanted:
        if not port_is_free(host, port):
            raise RuntimeError(
                f"port {port} on {host} for the {what} is in use: stop what listens there or pick another"
            )


def _cmd_serve(args: argparse.Namespace) -> int:
    from cachegw.gateway.config import load_settings

    settings = load_settings(args.config, host=args.host, port=args.port, data_dir=args.data_dir)
    check_ports(settings)  # in the first second, before torch and the models load
    from cachegw.gateway.serve import run_gateway

    run_gateway(settings)
    return 0


def _train_verifier(argv: list[str]) -> int:
    from cachegw.gateway.offline.train_verifier import main_train

    return main_train(argv)


def _calibrate(argv: list[str]) -> int:
    from cachegw.gateway.offline.calibrate import main_calibrate

    return main_calibrate(argv)


def _analyze(argv: list[str]) -> int:
    from cachegw.gateway.offline.analyze import main_analyze

    return main_analyze(argv)


def _export(argv: list[str]) -> int:
    from cachegw.gateway.offline.analyze import main_export

    return main_export(argv)


# Subcommands that parse their own arguments: everything after the name goes to them.
PASSTHROUGH = {
    "train-verifier": _train_verifier,
    "calibrate": _calibrate,
    "analyze": _analyze,
    "export": _export,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachegw", description="OpenAI-compatible caching gateway for LLMs")
    parser.add_argument("--version", action="version", version=f"cachegw {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve", help="start the caching gateway (and the built-in backend unless config names others)"
    )
    p.add_argument("--config", help="config file merged over the packaged config.toml")
    p.add_argument("--host", help="address to listen on (default from config)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--data-dir", help="where the database and index files live (default ./data)")
    _add_log_args(p)
    p.set_defaults(func=_cmd_serve)
    p = sub.add_parser("backend", help="start the built-in inference engine's OpenAI-compatible server")
    _add_backend_args(p)
    _add_log_args(p)
    p.set_defaults(func=_cmd_backend)
    sub.add_parser("train-verifier", help="fit the semantic-cache verifier (--pairs FILE.csv)")
    sub.add_parser(
        "calibrate", help="precision/recall against threshold on labelled pairs (--pairs FILE.csv)"
    )
    sub.add_parser("analyze", help="report on the request log: hit rates, similarities, savings, sweeps")
    sub.add_parser("export", help="write the request log as JSONL (for `cachegw analyze --jsonl`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in PASSTHROUGH:
            setup_logging()
            return PASSTHROUGH[argv[0]](argv[1:])
        args = build_parser().parse_args(argv)
        setup_logging(args.log_level, args.log_format)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"cachegw: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
