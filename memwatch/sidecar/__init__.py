"""The sidecar, ``memwatch serve``: the process beside the engine that drains its rings into the store.

An engine never waits for it: each rank writes fixed-size records into a ring file in the runtime
directory, and the sidecar finds those rings, checks every record, runs the detectors on them as they
arrive and commits them, each ring's cursor with its rows, through one writer thread. Its modules:

- :mod:`.daemon` — the process: its lock, the collector loop, the writer, retention, clean shutdown.
- :mod:`.pacing` — when the loop drains: once the busiest ring holds a batch, within a bounded wait.
- :mod:`.stop_flag` — a stop request a signal handler can make without taking a lock.
- :mod:`.health` — ``/healthz`` and ``/readyz`` for an orchestrator's probes.
- :mod:`.sidecar_files` — its private state directory: lock, pid file, presence marker.
- :mod:`.collector` — finds, drains and finishes rings, handing rows to the writer.
- :mod:`.ring_finder` — finding and opening rings in a directory another uid may write.
- :mod:`.refused_names` — ring names already refused, remembered up to a bound, with their reason.
- :mod:`.rejected_rings` — rings it cannot take, moved out of the way into a bounded ``rejected/``.
- :mod:`.ring_state` — what it knows of one ring: cursor, ending, the statements it stores with.
- :mod:`.record_checks` — every record and ring header checked before anything else sees it.
- :mod:`.run_rows` — the ``runs`` and ``ranks`` rows a ring's life writes.
- :mod:`.liveness` — whether a ring's writer is alive, without relying on seeing its pid.
- :mod:`.live` — the detectors run live on every drained record; flags stored and logged.
- :mod:`.log_limit` — log lines another uid can cause, limited per kind.

Nothing is imported here, so that a part that needs one of these modules (``attach`` asks
:mod:`.liveness`, the snapshot importer uses :mod:`.log_limit`) does not load the whole sidecar.
"""
