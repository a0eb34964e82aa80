"""Supervised servers: `make serve` (serve.py, one replica), N full replicas behind HAProxy with a
Prometheus (`make serve REPLICAS=N`), and the container's entrypoint (one replica that drains on
SIGTERM). docs/deploy.md.

Kept apart from `specgate_launcher` (which starts one tritonserver and one front): this package only
composes what the launcher starts, supervises it and puts a balancer and a Prometheus in front.
"""
