"""The Helm chart deploy/helm/memwatch, through the real Helm binary: it lints strictly, its schema refuses bad
values with Helm's own message, each switch adds or removes its objects, and the plain manifests in deploy/ are
its rendering. What the rendered objects mean (probes, capabilities, storage, policies) is tests/test_deploy.py's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helm_chart import CHART, HELM, ROOT, documents, helm, template

SCHEMA_ERROR = "values don't meet the specifications of the schema(s)"


def _render_module():
    """deploy/helm/render_manifests.py, which `make manifests` runs."""
    spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "deploy" / "helm" / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _kinds(release: str, *args: str) -> list[str]:
    return sorted(doc["kind"] for doc in documents(template(release, list(args))))


@pytest.mark.parametrize("mode", ["sidecar", "agent", "engine"])
def test_the_chart_lints_strictly(mode: str) -> None:
    done = helm("lint", "--strict", str(CHART), "--set", f"mode={mode}", "--set", "bundles.to=s3://b/p",
                "--set", "monitoring.serviceMonitor.enabled=true")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_the_plain_manifests_are_the_charts_rendering() -> None:
    render = _render_module()
    for path, release, values in render.MANIFESTS:
        fresh = render.render(str(HELM), release, values)
        assert (ROOT / path).read_text() == fresh, f"{path} is not the chart's rendering: run `make manifests`"


def test_each_shape_renders_its_objects_and_the_switches_add_and_remove_them() -> None:
    assert _kinds("e", "--set", "networkPolicy.enabled=false") == ["Deployment", "Service", "ServiceAccount"]
    assert _kinds("e") == ["Deployment", "NetworkPolicy", "Service", "ServiceAccount"]
    assert _kinds("e", "--set", "monitoring.serviceMonitor.enabled=true", "--set", "serviceAccount.create=false") == [
        "Deployment", "NetworkPolicy", "Service", "ServiceMonitor"]
    assert _kinds("e", "--set", "monitoring.podMonitor.enabled=true") == [
        "Deployment", "NetworkPolicy", "PodMonitor", "Service", "ServiceAccount"]
    assert _kinds("a", "--set", "mode=agent", "--set", "namespace.name=memwatch", "--set", "namespace.create=true") == [
        "DaemonSet", "Namespace", "NetworkPolicy", "Service", "ServiceAccount"]
    no_metrics = documents(template("a", ["--set", "mode=agent", "--set", "exporters.prometheus.enabled=false"]))
    assert sorted(d["kind"] for d in no_metrics) == ["DaemonSet", "NetworkPolicy", "ServiceAccount"]
    (policy,) = [d for d in no_metrics if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"] == []  # no pod reaches the agent at all
    assert _kinds("p", "--set", "mode=engine", "--set", "monitoring.podMonitor.enabled=true") == [
        "Pod", "ServiceAccount"]


def test_images_are_named_where_they_are_pushed() -> None:
    docs = documents(template("e", ["--set", "image.memwatch.registry=ghcr.io/acme/", "--set", "image.engine.tag=1.2",
                                    "--set", "image.memwatch.digest=sha256:" + "ab" * 32]))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["initContainers"][0]["image"] == "ghcr.io/acme/memwatch@sha256:" + "ab" * 32
    assert spec["containers"][0]["image"] == "registry.example.com/ml-platform/vllm-memwatch:1.2"


def test_the_ordinary_container_fallback_and_the_version_check() -> None:
    done = helm("template", "e", str(CHART), "--kube-version", "1.28.0")
    assert done.returncode != 0 and "set memwatch.nativeSidecar=false" in done.stderr
    docs = documents(template("e", ["--kube-version", "1.28.0", "--set", "memwatch.nativeSidecar=false"]))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert "initContainers" not in spec and [c["name"] for c in spec["containers"]] == ["memwatch", "vllm"]


@pytest.mark.parametrize(("args", "where"), [
    (["--set", "mode=daemonset"], "at '/mode': value must be one of 'sidecar', 'agent', 'engine'"),
    (["--set", "engine.model=vllm"], "at '/engine/model'"),  # would make `vllm serve vllm ...`
    (["--set", "trust.sidecarUid=0"], "at '/trust/sidecarUid'"),  # the sidecar runs as a non-root uid
    (["--set", "retention.keepFull=1day"], "at '/retention/keepFull'"),
    (["--set", "storage.sizeLimit=lots"], "at '/storage/sizeLimit'"),
    (["--set", "exporters.prometheus.port=70000"], "at '/exporters/prometheus/port'"),
    (["--set", "tracing.enabled=true"], "additional properties 'tracing' not allowed"),  # memwatch has none
    (["--set", "bundles.to=ftp://host/x"], "at '/bundles/to'"),  # serve --bundle-to takes a folder or s3/gs/az
    # Both monitors scrape the same port: every series twice.
    (["--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true"],
     "at '/monitoring/podMonitor/enabled': value must be false"),
    # The operator's own duration pattern: a unit always, no fraction.
    (["--set-string", "monitoring.serviceMonitor.interval=30"], "at '/monitoring/serviceMonitor/interval'"),
    (["--set", "monitoring.podMonitor.interval=1.5s"], "at '/monitoring/podMonitor/interval'"),
    (["--set", "monitoring.podMonitor.scrapeTimeout=10 s"], "at '/monitoring/podMonitor/scrapeTimeout'"),
    (["--set", "monitoring.podMonitor.relabelings=drop"], "at '/monitoring/podMonitor/relabelings'"),
    (["--set-json", 'extraVolumes=[{"emptyDir":{}}]'], "at '/extraVolumes/0'"),  # a volume needs its name
    (["--set-json", 'memwatch.extraVolumeMounts=[{"name":"x","mountPath":"tmp"}]'],
     "at '/memwatch/extraVolumeMounts/0/mountPath'"),
])
def test_the_schema_refuses_bad_values_with_helms_message(args: list[str], where: str) -> None:
    done = helm("template", "e", str(CHART), *args)
    assert done.returncode != 0
    assert SCHEMA_ERROR in done.stderr and where in done.stderr, done.stderr


@pytest.mark.parametrize("duration", ["1m30s", "500ms", "2h", "1d", "0", ""])
def test_the_schema_takes_the_operators_durations(duration: str) -> None:
    # Each matches monitoring.coreos.com's Duration pattern, which the operator's CRDs enforce.
    for monitor in ("serviceMonitor", "podMonitor"):
        docs = documents(template("e", ["--set", f"monitoring.{monitor}.enabled=true",
                                        "--set-string", f"monitoring.{monitor}.interval={duration}"]))
        (found,) = [d for d in docs if d["kind"].lower() == monitor.lower()]
        (endpoint,) = found["spec"]["endpoints" if monitor == "serviceMonitor" else "podMetricsEndpoints"]
        assert endpoint.get("interval") == (duration or None)  # "" leaves Prometheus' own default


def test_the_templates_refuse_both_monitors_and_a_timeout_past_the_interval() -> None:
    # With the schema skipped (helm --skip-schema-validation), the template says it itself.
    done = helm("template", "e", str(CHART), "--skip-schema-validation",
                "--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true")
    assert done.returncode != 0
    assert "monitoring.serviceMonitor and monitoring.podMonitor are both enabled" in done.stderr, done.stderr
    # Prometheus refuses a scrape_timeout longer than its scrape_interval: 1m30s is 90,000 ms, 1m31s 91,000 ms.
    done = helm("template", "e", str(CHART), "--set", "monitoring.podMonitor.enabled=true",
                "--set", "monitoring.podMonitor.interval=1m30s", "--set", "monitoring.podMonitor.scrapeTimeout=1m31s")
    assert done.returncode != 0 and "scrapeTimeout 1m31s exceeds interval 1m30s" in done.stderr, done.stderr
    docs = documents(template("e", ["--set", "monitoring.podMonitor.enabled=true",
                                    "--set", "monitoring.podMonitor.interval=1m30s",
                                    "--set", "monitoring.podMonitor.scrapeTimeout=90000ms"]))
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["scrapeTimeout"] == "90000ms"
    done = helm("template", "e", str(CHART), "--set", "monitoring.serviceMonitor.enabled=true",
                "--set", "exporters.prometheus.enabled=false")
    assert done.returncode != 0 and "need exporters.prometheus.enabled" in done.stderr, done.stderr


def test_an_egress_policy_only_when_bundles_go_somewhere() -> None:
    def policies(*args: str) -> dict[str, dict]:
        docs = documents(template("e", list(args)))
        return {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}

    assert list(policies()) == ["e"]  # ingress only: without bundles memwatch's egress is left as it was
    assert list(policies("--set", "mode=agent")) == ["e"]
    assert list(policies("--set", "bundles.to=s3://b/p", "--set", "networkPolicy.enabled=false")) == []
    assert not policies("--set", "mode=engine", "--set", "bundles.to=s3://b/p")  # memwatch is not in that pod
    bucket = policies("--set", "bundles.to=s3://b/p")["e-egress"]["spec"]
    assert bucket["policyTypes"] == ["Egress"]
    dns, store = bucket["egress"]
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert store == {"ports": [{"port": 443, "protocol": "TCP"}],
                     "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]}
    # A folder needs no network: DNS alone. The OTLP collector's port is added when OTLP is on.
    (folder,) = policies("--set", "mode=agent", "--set", "bundles.to=file:///var/lib/memwatch/incidents",
                         "--set", "exporters.otlp.enabled=true", "--set", "exporters.otlp.endpoint=https://otel")[
        "e-egress"]["spec"]["egress"][1:]
    assert folder == {"ports": [{"port": 443, "protocol": "TCP"}]}
    narrowed = policies("--set", "bundles.to=az://c/p", "--set-json",
                        'networkPolicy.egress.bundleStore.to=[{"ipBlock":{"cidr":"10.9.0.0/16"}}]', "--set-json",
                        'networkPolicy.egress.extraEgress=[{"ports":[{"port":8000}]}]')["e-egress"]["spec"]["egress"]
    assert narrowed[1]["to"] == [{"ipBlock": {"cidr": "10.9.0.0/16"}}] and narrowed[2] == {"ports": [{"port": 8000}]}


def test_rollups_kept_for_ever_need_a_cap() -> None:
    done = helm("template", "e", str(CHART), "--set", "retention.keepRollups=forever", "--set", "retention.maxDbSize=0")
    assert done.returncode != 0 and "the database would grow for ever" in done.stderr, done.stderr
    capped = documents(template("e", ["--set", "retention.keepRollups=forever", "--set", "retention.maxDbSize=1GB"]))
    (deployment,) = [d for d in capped if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert "--keep-rollups=forever" in args and "--max-db-size=1GB" in args


def test_a_created_namespace_needs_a_name() -> None:
    done = helm("template", "a", str(CHART), "--set", "mode=agent", "--set", "namespace.create=true")
    assert done.returncode != 0 and "namespace.create needs namespace.name" in done.stderr


def test_helm_is_the_pinned_release() -> None:
    done = helm("version", "--short")
    assert done.returncode == 0 and done.stdout.startswith("v4.1.4"), done.stdout + done.stderr
    assert Path(HELM).stat().st_mode & 0o111
