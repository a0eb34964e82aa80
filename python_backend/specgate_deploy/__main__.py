"""`python -m specgate_deploy` = `make serve REPLICAS=N` (cluster.py)."""

from specgate_deploy.cluster import main

main()
