"""The Ray Serve application: an ingress deployment in front of ``--replicas`` redlite
replicas, routed by :class:`redlite.cluster.router.AffinityRouter` (or Ray Serve's default or
round-robin router, for comparison).

``serve run redlite.cluster.app:app_builder replicas=2 engine=echo`` also works: the keyword
arguments are ``serve-cluster`` options (dashes as underscores).
"""

from __future__ import annotations

import argparse

from ray import serve
from ray.serve.config import RequestRouterConfig

from redlite.cluster.ingress import Ingress
from redlite.cluster.options import add_cluster_options
from redlite.cluster.replica import Replica

ROUTER_CLASSES = {
    "affinity": "redlite.cluster.router.AffinityRouter",
    "round-robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
}


def build_app(args: argparse.Namespace):
    """The bound application for the ``serve-cluster`` options ``args``."""
    options = {"num_replicas": args.replicas,
               "max_ongoing_requests": max(1, args.queue + 1),
               "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
               "graceful_shutdown_timeout_s": 60}
    if args.router in ROUTER_CLASSES:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[args.router],
            request_router_kwargs={"max_waiting": args.affinity_max_waiting}
            if args.router == "affinity" else {})
    replicas = serve.deployment(Replica, name="redlite").options(**options)
    ingress = serve.deployment(Ingress, name="ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(replicas.bind(replica_args(args)), args.log_level)


def replica_args(args: argparse.Namespace) -> argparse.Namespace:
    """The ``redlite serve`` options of ``args`` (the cluster's own dropped: changing the
    replica count does not change what each replica is)."""
    cluster = argparse.ArgumentParser()
    add_cluster_options(cluster)
    dropped = {a.dest for a in cluster._actions}
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in dropped})


def app_builder(config: dict):
    """``serve run`` entry: ``config`` holds ``serve-cluster`` options by name."""
    from redlite.cli import build_parser

    argv = ["serve-cluster"]
    for name, value in config.items():
        flag = f"--{name.replace('_', '-')}"
        argv += [flag] if value is True else [] if value is False else [flag, str(value)]
    return build_app(build_parser().parse_args(argv))
