"""The ``serve-cluster`` options (Ray-free: the CLI parser imports this without Ray)."""

from __future__ import annotations

import argparse

ROUTERS = ("affinity", "default", "round-robin")


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """Add the replica and router options to the ``serve-cluster`` parser (the ``serve``
    options are there already: every replica gets them, ``--host``/``--port`` are the
    cluster's HTTP address)."""
    parser.add_argument("--replicas", type=int, default=2, help="redlite servers (Ray Serve replicas)")
    parser.add_argument("--router", choices=ROUTERS, default="affinity",
                        help="affinity: each conversation to the replica holding its state; "
                             "default: Ray Serve's power-of-two-choices; round-robin: Ray "
                             "Serve's round-robin (both for comparison)")
    parser.add_argument("--affinity-max-waiting", type=int, default=4,
                        help="requests in flight on a conversation's replica at which the "
                             "router sends it to the least-loaded replica instead")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    parser.add_argument("--replica-gpus", type=float, default=0.0,
                        help="GPUs Ray reserves per replica (1: one replica per GPU)")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to join (e.g. auto); default: start a local one")
