"""``redlite serve-cluster``: start (or join) Ray, run the application on Ray Serve's HTTP
proxy at ``--host``/``--port``, and on SIGINT/SIGTERM remove it (each replica saves its
conversations to ``--session-dir``) and stop."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from redlite.core.session_dir import SessionDirError, prepare_session_dir
from redlite.server.security import security_from_args

log = logging.getLogger("redlite.cluster")

APP_NAME = "redlite"


def start_cluster(args: argparse.Namespace) -> None:
    """Start Ray (``--ray-address`` or a local instance) and run the application; returns once
    every replica is up. Raises what Ray raises."""
    import ray
    from ray import serve

    from redlite.cluster.app import build_app

    if not ray.is_initialized():
        ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")


def stop_cluster() -> None:
    """Remove the application (replicas save their conversations) and stop Serve and Ray."""
    import ray
    from ray import serve

    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()


def serve_cluster(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns the exit status (1: bad options or Ray failed)."""
    try:
        security_from_args(args)
        if args.session_dir:
            prepare_session_dir(args.session_dir)
    except (OSError, ValueError, SessionDirError) as error:
        log.error("%s", error)
        return 1
    if args.replicas < 1:
        log.error("--replicas must be at least 1")
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start_cluster(args)
    except Exception as error:  # Ray's own errors: one line, the details are in Ray's log
        log.error("cannot start the cluster: %s", error)
        return 1
    log.info("listening on http://%s:%d (%d replicas, %s router)", args.host, args.port,
             args.replicas, args.router)
    stop.wait()
    log.info("stopping: replicas save their conversations")
    stop_cluster()
    return 0
