"""Load tests: Locust users over HTTP generate_stream and gRPC streaming, workloads, scenario runner."""
