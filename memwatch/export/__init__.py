"""Export from the sidecar: OpenTelemetry metrics (Prometheus scrape, OTLP/HTTP, console) and flag log records.

One module per concern: ``state`` (what is published, fed by the collector), ``instruments`` (the
metric names and units), ``headroom`` and ``latest_sample`` (the routing signal on ``/metrics``),
``flag_logs`` (flags as log records), ``prometheus`` and ``otlp`` (the transports), ``config`` (options
and environment), ``pipeline`` (all of it put together).
Nothing here is imported unless the sidecar exports: a plain ``memwatch serve`` loads no exporter.
"""
