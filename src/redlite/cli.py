"""Command line: ``redlite serve [options]``, ``redlite serve-cluster --replicas N [options]``
and ``redlite --version``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from redlite import __version__
from redlite.engine.kernel_options import add_kernel_options

log = logging.getLogger("redlite")

#: the environment variable giving ``--cache-dir``'s default (read here only, at the command line)
CACHE_DIR_ENV = "REDLITE_CACHE_DIR"


def process_age_s() -> float:
    """Seconds since this process started (from /proc; falls back to time since import)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


_IMPORTED_AT = time.monotonic()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help once: not when the help already says its
    default, nor for defaults that mean "off" or "not given" (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default is None or action.default is False:
            return help_text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The options of one redlite server (``serve``; each replica of ``serve-cluster``)."""
    parser.add_argument("--model", help="GGUF file or Hugging Face directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", choices=["torch", "echo"], default="torch",
                       help="torch: the model; echo: model-free test engine that answers with the "
                            "last user message (tokens are UTF-8 bytes)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument("--ctx-size", type=positive_int, default=None,
                       help="context length in tokens (default: the model's, capped at 8192 on CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="weights and state dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--max-body-mib", type=float, default=8.0, help="largest request body (413 above)")
    parser.add_argument("--body-timeout-s", type=float, default=30.0,
                       help="time allowed for a whole request body, seconds (408 after it)")
    parser.add_argument("--header-timeout-s", type=float, default=10.0, help="time-out for a request's headers")
    parser.add_argument("--queue", type=int, default=16, help="requests that may wait behind the running ones")
    parser.add_argument("--parallel", type=positive_int, default=1,
                       help="conversations generated at once, their decode steps batched (default 1: "
                            "one at a time); each has its own slot of engine state")
    parser.add_argument("--decode-ahead", choices=["auto", "on", "off"], default="auto",
                       help="with --parallel: run the next batched step while the conversations' stop/tool "
                            "scans of the previous token run (a token that ends an answer is taken back); "
                            "auto (default): on where the engine computes on a GPU, off on CPU, where the "
                            "scans and the kernels share the cores")
    parser.add_argument("--prefill-chunk", type=positive_int, default=512,
                       help="most prompt tokens per prefill step; a request that is cancelled "
                            "(client gone, shutdown) stops between steps")
    parser.add_argument("--max-tokens", type=int, default=4096,
                       help="server-side cap on the tokens generated for any request (0: none)")
    parser.add_argument("--no-reuse", action="store_true", help="never reuse held state (every plan resets)")
    parser.add_argument("--checkpoint-interval", type=int, default=1024, help="tokens between checkpoints in long prefills")
    parser.add_argument("--checkpoint-min-piece", type=int, default=None,
                        help="fewest tokens between two checkpoint cuts of one prefill (each piece costs a "
                             "forward pass; 0: a cut at every message boundary; default: the engine's, 64 "
                             "on a GPU after the warm-up, else 0)")
    parser.add_argument("--checkpoint-mib", type=float, default=512.0,
                       help="memory for recurrent-state checkpoints (models that cannot rewind); 0: none")
    parser.add_argument("--park-mib", type=float, default=2048.0,
                       help="host memory for parked conversations, MiB (fractions allowed; 0: none)")
    parser.add_argument("--park-slots", type=int, default=8, help="most conversations parked in RAM")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU, compile kernels and capture CUDA graphs before serving "
                             "(the first request then runs at full speed)")
    parser.add_argument("--park-device-mib", type=float, default=4096.0,
                       help="device memory (GPU) for parked conversations, MiB: a fork's discarded "
                            "tail stays there while it fits, else goes to host RAM (0: host only)")
    parser.add_argument("--session-dir", default=None,
                       help="directory of saved conversations (disk tier; off when not given)")
    parser.add_argument("--session-min-tokens", type=int, default=512,
                       help="smallest conversation written to --session-dir, tokens")
    parser.add_argument("--session-keep", type=int, default=12, help="most session files kept")
    parser.add_argument("--session-max-gb", type=float, default=20.0, help="most GB of session files kept")
    parser.add_argument("--slot-save-path", default=None,
                       help="directory of the llama.cpp-style slot API's files (API off when not given)")
    parser.add_argument("--api-key", action="append", metavar="KEY",
                       help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every "
                            "route but /health (repeatable)")
    parser.add_argument("--api-key-file", action="append", metavar="PATH",
                       help="file of API keys, one per line (repeatable)")
    parser.add_argument("--allowed-host", action="append", metavar="NAME",
                       help="a Host name accepted besides localhost, 127.0.0.1 and [::1] "
                            "(repeatable; the Host check stops DNS rebinding)")
    parser.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                       help="an origin (e.g. http://localhost:3000) that gets CORS headers "
                            "(repeatable; none by default)")
    parser.add_argument("--echo-delay-ms", type=float, default=0.0, help="echo engine: delay per decoded token")
    parser.add_argument("--echo-prefill-delay-ms", type=float, default=0.0,
                       help="echo engine: delay per prefilled token")
    parser.add_argument("--echo-snapshot-delay-ms", type=float, default=0.0,
                       help="echo engine: delay per state copy (parking, saving)")
    parser.add_argument("--echo-no-rewind", action="store_true", help="echo engine: behave like a recurrent model")
    parser.add_argument("--tool-parser", default=None, choices=["hermes", "qwen3_coder", "llama3_json"],
                       help="tool-call format of the output (default: detected from the chat template)")
    parser.add_argument("--replay", default="exact", choices=["exact", "template"],
                       help="exact (default): assistant turns the server generated are sent to the "
                       "model again as the exact tokens it generated (reasoning included), however "
                       "the client re-serializes them; template: every turn renders through the "
                       "chat template")
    parser.add_argument("--reasoning-parser", default=None, choices=["qwen3", "none"],
                       help="reasoning markup of the output (default: qwen3 when the chat template "
                            "mentions <think>, else none)")
    parser.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                       help="serve GET /metrics (Prometheus) and count requests for it")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                       help="log lines as text or as JSON objects (one per line)")
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    parser.add_argument("--cache-dir", default=os.environ.get(CACHE_DIR_ENV) or None, metavar="PATH",
                        help=f"where GGUF files are converted to once (default: ${CACHE_DIR_ENV} "
                             "when set, else ~/.cache/redlite)")
    add_kernel_options(parser)


def build_parser() -> argparse.ArgumentParser:
    """The ``redlite`` argument parser (``serve`` and its options, ``--version``)."""
    parser = argparse.ArgumentParser(prog="redlite", description="redlite: an OpenAI-compatible "
                                     "LLM server that keeps conversation state across turns")
    parser.add_argument("--version", action="version", version=f"redlite {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                formatter_class=_HelpFormatter)
    add_serve_options(serve)
    cluster = commands.add_parser("serve-cluster", formatter_class=_HelpFormatter,
                                  help="serve N replicas on Ray Serve, routing each "
                                       "conversation to the replica holding its state")
    add_serve_options(cluster)
    from redlite.cluster.options import add_cluster_options  # Ray-free: the parser only
    add_cluster_options(cluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "log_format", "text") == "json":
        from redlite.logformat import use_json
        use_json()
    if args.command == "serve":
        import gc

        gc.disable()  # no collections while importing torch (~0.5 s); on again once loaded (run.py)
        from redlite.server.shutdown import Stopper
        stopper = Stopper()
        stopper.install()  # before the heavy imports: a signal while starting exits with 0
        from redlite.server.run import serve
        status = serve(args, stopper)
    elif args.command == "serve-cluster":
        from redlite.cluster.run import serve_cluster
        status = serve_cluster(args)
    else:
        return 2
    from redlite.server.shutdown import ignore_stop_signals
    ignore_stop_signals()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
