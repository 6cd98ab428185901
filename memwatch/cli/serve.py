"""``memwatch serve``: run the sidecar in the foreground."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import click

from memwatch_engine.runtime import trusted_uids

from ..detectors import DetectorConfig
from ..incident.ship import TERMINATION_LOG
from ..sidecar.claim import SidecarRunning
from ..sidecar.daemon import NO_RING_AFTER_S, Sidecar
from ..sidecar.shipping import BundleSettings
from ..store.moments import parse_duration_ns
from ..store.retention import DEFAULT_EVIDENCE_NS, DEFAULT_FULL_NS, DEFAULT_ROLLUPS_NS, Retention
from ..units import parse_bytes
from .options import Seconds, db_option, thresholds_option


@click.command("serve")
@db_option
@click.option("--runtime-dir", type=click.Path(file_okay=False, path_type=Path), envvar="MEMWATCH_RUNTIME_DIR",
              help="Where engines put their rings (default: $MEMWATCH_RUNTIME_DIR, $XDG_RUNTIME_DIR/memwatch).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), envvar="MEMWATCH_STATE_DIR",
              help="The sidecar's own files (lock, pid file, refused rings), in a directory of its user, mode 0700 "
                   "(created so). Default: the runtime directory when it is private; for a shared one, "
                   "sidecar-<its path>-<hash> beside the database (env MEMWATCH_STATE_DIR).")
@click.option("--poll-interval", type=Seconds(0.0, 60.0, low_open=True), default=0.25, show_default=True,
              help="Seconds between looks at the rings (more than 0, at most 60): a ring is drained once it "
                   "holds a batch (1,024 records) or closed, and at least every 8 intervals.")
@click.option("--exit-when-idle", type=Seconds(0.0), default=None,
              help="Exit after this many seconds with no engine writing (used when auto-started).")
@click.option("--give-up-after", type=Seconds(0.0, low_open=True), default=60.0, show_default=True,
              help="Seconds a locked database is retried before the sidecar exits (status 4).")
@click.option("--quiet-if-running", is_flag=True, hidden=True,
              help="Exit 0 silently when a sidecar already serves the directory.")
@click.option("--no-detect", is_flag=True, help="Store timelines only; do not run the detectors live.")
@thresholds_option
@click.option("--keep-full", default=f"{DEFAULT_FULL_NS // 10**9}s", show_default=True,
              help="Keep this much of the end of every run at full resolution; older samples are rolled up per second.")
@click.option("--keep-evidence", default=f"{DEFAULT_EVIDENCE_NS // 10**9}s", show_default=True,
              help="Keep this much either side of every flag and OOM at full resolution.")
@click.option("--keep-rollups", default=f"{DEFAULT_ROLLUPS_NS // 10**9 // 3600}h", show_default=True,
              help="Keep the per-second rows of this much of the end of every run (a week is 168h; 'forever' keeps "
                   "them all).")
@click.option("--max-db-size", default="0", show_default=True, metavar="SIZE",
              help="Cap the database's pages in use (e.g. 1500MB, 1.5GiB; 0: no cap): past it, the samples of the runs "
                   "not being stored go, oldest first, then the live runs' oldest per-second rows; runs, flags, "
                   "events and summaries stay, and a live run's last hour and evidence are never dropped.")
@click.option("--no-ring-warning", type=Seconds(0.0, low_open=True), default=NO_RING_AFTER_S, show_default=True,
              metavar="SECONDS", help="Say once (log and /readyz) when no ring has arrived this long after the start.")
@click.option("--prometheus", metavar="[HOST:]PORT", default=None,
              help="Serve metrics for Prometheus to scrape at http://HOST:PORT/metrics (host 127.0.0.1 unless "
                   "given; env MEMWATCH_PROMETHEUS).")
@click.option("--admission-shape", "admission_shapes", multiple=True, metavar="PROMPT:OUTPUT",
              envvar="MEMWATCH_ADMISSION_SHAPES",
              help="Export memwatch_admissible_requests for requests of this many prompt and output tokens "
                   "(repeatable; env MEMWATCH_ADMISSION_SHAPES, space-separated). Default: 512:256, 2048:512 and "
                   "8192:1024 (chat, a retrieval prompt, a long context).")
@click.option("--signal-stale-after", type=Seconds(0.0, 3600.0, low_open=True), default=None, metavar="SECONDS",
              help="memwatch_signal_valid turns 0 when a rank of the engine has not written for this long "
                   "(default 1.5: a stopped engine reads invalid within 2 s).")
@click.option("--output-quantile", type=float, default=None, metavar="Q", envvar="MEMWATCH_OUTPUT_QUANTILE",
              help="memwatch_kv_expected_usage_ratio assumes the running requests reach this quantile of the share "
                   "of max_tokens the engine's finished requests generated (default 0.9: one in ten runs "
                   "further; 1: the longest seen; env MEMWATCH_OUTPUT_QUANTILE).")
@click.option("--otlp", metavar="[ENDPOINT]", is_flag=False, flag_value="1", default=None,
              help="Push metrics and flag log records over OTLP/HTTP (protobuf) to ENDPOINT, e.g. "
                   "http://collector:4318; without one, OTEL_EXPORTER_OTLP_ENDPOINT or localhost:4318 "
                   "(env MEMWATCH_OTLP).")
@click.option("--console", "console", is_flag=True, default=False,
              help="Print metrics and flag log records to stdout every export period (env MEMWATCH_CONSOLE=1).")
@click.option("--trust-uid", "trust_uids", type=click.IntRange(0, 2**32 - 2), multiple=True, metavar="UID",
              help="Also store the rings written by this uid (repeatable; env MEMWATCH_TRUST_UIDS, a comma list). "
                   "Rings of other uids are ignored with a log line naming the uid.")
@click.option("--runtime-group", type=click.IntRange(0, 2**32 - 2), metavar="GID", default=None,
              envvar="MEMWATCH_RUNTIME_GROUP",
              help="Create a missing runtime directory shared with this group (mode 3770: setgid, sticky, no "
                   "access for others), for engines running as other uids (env MEMWATCH_RUNTIME_GROUP).")
@click.option("--health", metavar="[HOST:]PORT", default=None, envvar="MEMWATCH_HEALTH",
              help="Answer GET /healthz (the loop and store writer run) and /readyz (storing now) on this port, "
                   "for liveness and readiness probes (host 127.0.0.1 unless given; env MEMWATCH_HEALTH).")
@click.option("--bundle-to", metavar="URL", default=None, envvar="MEMWATCH_BUNDLE_TO",
              help="Ship incident bundles here: a folder (a path or file:///dir) or an object store prefix "
                   "(s3://bucket/prefix, gs://…, az://container/prefix; credentials from the cloud SDKs' "
                   "environment). Spooled in the state directory first; needs memwatch[bundles] "
                   "(env MEMWATCH_BUNDLE_TO).")
@click.option("--termination-log", type=click.Path(dir_okay=False, path_type=Path), default=str(TERMINATION_LOG),
              show_default=True, envvar="MEMWATCH_TERMINATION_LOG",
              help="Write each shipped bundle's verdict and URL here when the file exists (a pod's termination "
                   "message; env MEMWATCH_TERMINATION_LOG).")
@click.option("--spool-max-bytes", default="256MiB", show_default=True, metavar="SIZE",
              envvar="MEMWATCH_SPOOL_MAX_BYTES",
              help="The most the bundles waiting to be shipped may take; over it, the oldest are dropped, each with a "
                   "bundle_dropped event (env MEMWATCH_SPOOL_MAX_BYTES; docs/incidents.md sizes it).")
@click.option("--spool-max-bundles", type=click.IntRange(1, 100_000), default=64, show_default=True, metavar="N",
              envvar="MEMWATCH_SPOOL_MAX_BUNDLES",
              help="The most bundles waiting to be shipped; over it, the oldest are dropped (env "
                   "MEMWATCH_SPOOL_MAX_BUNDLES).")
@click.option("--bundles-per-hour", type=click.IntRange(0, 100_000), default=10, show_default=True, metavar="N",
              envvar="MEMWATCH_BUNDLES_PER_HOUR",
              help="Incident bundles an hour per engine uid (a burst of N, then one each 3600/N s; 0: no limit); the "
                   "rest are dropped with a log line (env MEMWATCH_BUNDLES_PER_HOUR).")
@click.option("--grace-period", type=Seconds(1.0, 86400.0), default=30.0, show_default=True, metavar="SECONDS",
              envvar="MEMWATCH_GRACE_PERIOD",
              help="The time a stop (SIGTERM) may take, as the pod's terminationGracePeriodSeconds gives it: the last "
                   "drain, the bundles of the runs still active and their uploads share it, and what cannot be "
                   "uploaded in time waits in the spool for the next start (env MEMWATCH_GRACE_PERIOD).")
def command(db_path: Path | None, runtime_dir: Path | None, state_dir: Path | None, poll_interval: float,
            exit_when_idle: float | None, give_up_after: float, quiet_if_running: bool, no_detect: bool,
            detector_config: DetectorConfig | None, keep_full: str, keep_evidence: str, keep_rollups: str,
            max_db_size: str, no_ring_warning: float,
            prometheus: str | None, admission_shapes: tuple[str, ...], signal_stale_after: float | None,
            output_quantile: float | None, otlp: str | None, console: bool, trust_uids: tuple[int, ...],
            runtime_group: int | None, health: str | None, bundle_to: str | None, termination_log: Path,
            spool_max_bytes: str, spool_max_bundles: int, bundles_per_hour: int, grace_period: float) -> None:
    """Store every engine's timeline in SQLite, live, until stopped (SIGTERM or Ctrl-C).

    With --prometheus, --otlp or --console (or their MEMWATCH_* variables, or OTEL_METRICS_EXPORTER)
    it also exports each live rank's GPU memory, ledger and flags as OpenTelemetry metrics, and on
    /metrics each engine's memory headroom for routers (docs/routing.md).
    """
    from ..export.config import export_config, parse_listen
    from ..export.headroom import DEFAULT_SHAPES, DEFAULT_STALE_AFTER_S, HeadroomConfig, parse_quantile, parse_shape
    from ..export.output_lengths import DEFAULT_QUANTILE

    rollups = None if keep_rollups == "forever" else parse_duration_ns(keep_rollups)
    retention = Retention(parse_duration_ns(keep_full), parse_duration_ns(keep_evidence), rollups,
                          parse_bytes(max_db_size) or None)
    if bundle_to:
        from ..incident.objstore import parse, require

        parse(bundle_to)  # a bad URL (exit 2) or no obstore (exit 4): one line before anything starts
        require()
    config = export_config(prometheus, otlp, console)
    shapes = tuple(dict.fromkeys(parse_shape(shape) for shape in admission_shapes)) or DEFAULT_SHAPES
    stale_after = DEFAULT_STALE_AFTER_S if signal_stale_after is None else signal_stale_after
    quantile = DEFAULT_QUANTILE if output_quantile is None else parse_quantile(output_quantile)
    config = replace(config, headroom=HeadroomConfig(shapes, stale_after, quantile))
    health_at = parse_listen(health, "--health") if health is not None else None
    exporters = None
    if config.enabled:
        from ..export.pipeline import Exporters

        exporters = Exporters(config)
    sidecar = Sidecar(runtime_dir, db_path, poll_interval=poll_interval, exit_when_idle=exit_when_idle,
                      give_up_after=give_up_after, detect=not no_detect, detector_config=detector_config,
                      retention=retention, exporters=exporters, trust_uids=trust_uids, runtime_group=runtime_group,
                      state_dir=state_dir, no_ring_after=no_ring_warning,
                      bundles=BundleSettings.from_env(bundle_to, termination_log,
                                                      spool_bytes=parse_bytes(spool_max_bytes),
                                                      spool_count=spool_max_bundles, per_hour=bundles_per_hour,
                                                      grace_s=grace_period))
    sidecar.install_signal_handlers()  # before the lock: whoever sees the lock may signal us at once
    try:
        sidecar.start()
    except SidecarRunning:
        if quiet_if_running:
            return
        raise
    logging.getLogger("memwatch").setLevel(min(logging.getLogger().level, logging.INFO))
    if sidecar.took_over_from is not None:
        click.echo(f"memwatch serve: took over from the auto-started sidecar (pid {sidecar.took_over_from})",
                   err=True)
    click.echo(f"memwatch serve: rings in {sidecar.runtime_dir}, database {sidecar.db_path}", err=True)
    if sidecar.state_dir != sidecar.runtime_dir:
        click.echo(f"memwatch serve: its own files (lock, pid, refused rings) in {sidecar.state_dir}", err=True)
    trusted = sorted(trusted_uids(trust_uids))
    if trusted:
        click.echo(f"memwatch serve: also storing the rings of uid {', '.join(map(str, trusted))}", err=True)
    shipping = None if sidecar.incidents is None else sidecar.incidents.shipping
    if shipping is not None:
        click.echo(f"memwatch serve: shipping incident bundles to {bundle_to} (spool {shipping.spool.path})",
                   err=True)
    if exporters is not None:
        where = exporters.describe()
        click.echo(f"memwatch serve: exporting to {', '.join(where)}", err=True)
    endpoint = None
    if health_at is not None:
        from ..sidecar.health import STALE_AFTER_S, HealthEndpoint, with_bundles

        incidents = sidecar.incidents
        endpoint = HealthEndpoint(*health_at, with_bundles(lambda: sidecar.health(STALE_AFTER_S),
                                                           lambda: None if incidents is None else incidents.overdue()))
        try:
            endpoint.start()
        except BaseException:
            sidecar.close()
            raise
        click.echo(f"memwatch serve: health on http://{endpoint.host}:{endpoint.port}/healthz and /readyz", err=True)
    try:
        sidecar.run()
    finally:
        if endpoint is not None:
            endpoint.close()
    c = sidecar.collector
    refused = "" if not c.rings_set_aside else f"; {c.rings_set_aside} ring(s) refused and moved to rejected/" \
        if c.rings_moved_aside == c.rings_set_aside else \
        f"; {c.rings_set_aside} ring(s) refused, {c.rings_moved_aside} of them moved to rejected/"
    click.echo(f"memwatch serve: stopped after {c.records_total} records ({c.lost_total} lost, "
               f"{c.set_aside_total} set aside){refused}", err=True)
