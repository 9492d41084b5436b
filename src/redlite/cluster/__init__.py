"""redlite as N replicas on Ray Serve, each conversation routed to the replica holding its
state (``redlite serve-cluster``; docs/scaling.md). Ray is imported only by the modules that
need it: :mod:`redlite.cluster.affinity` and :mod:`redlite.cluster.options` are Ray-free."""
