"""What operators see of Reach: traces, logs and metrics (each in a module of its own;
`reach.telemetry.metrics` holds the Prometheus metrics)."""
