"""The Kubernetes Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards), the
``baseline`` and ``restricted`` controls, checked on a pod spec as the admission controller reads the fields:
what an operator's namespace label would refuse, without a cluster.

Each check names the field that fails; ``violations(spec, "restricted")`` is every baseline and restricted control.
"""

from __future__ import annotations

from typing import Any

Spec = dict[str, Any]

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
"""Baseline "Capabilities": adding any other is refused."""
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
"""Restricted "Volume Types": a volume of any other source is refused (hostPath already by baseline)."""


def containers(spec: Spec) -> list[Spec]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def baseline(spec: Spec) -> list[str]:
    """Baseline's controls: no host namespaces, privilege, added capabilities beyond the default set, hostPath,
    host ports, unconfined seccomp, custom AppArmor/SELinux/procMount or unsafe sysctls."""
    found = []
    pod = spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"spec.{field}")
    contexts = [("spec.securityContext", pod), *((f"{c['name']}.securityContext", c.get("securityContext", {}))
                                                 for c in containers(spec))]
    for where, context in contexts:
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{where}.windowsOptions.hostProcess")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{where}.seccompProfile Unconfined")
        if context.get("appArmorProfile", {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            found.append(f"{where}.appArmorProfile")
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{where}.seLinuxOptions")
    for container in containers(spec):
        context = container.get("securityContext", {})
        if context.get("privileged"):
            found.append(f"{container['name']}.securityContext.privileged")
        if set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            found.append(f"{container['name']}.securityContext.capabilities.add")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{container['name']}.securityContext.procMount")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{container['name']}.ports.hostPort")
    found += [f"volume {v['name']}: hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    found += [f"sysctl {s['name']}" for s in pod.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    return found


def restricted(spec: Spec) -> list[str]:
    """Restricted's own controls: volume types, no privilege escalation, non-root (and not uid 0), a RuntimeDefault
    or Localhost seccomp profile, every capability dropped and none added but NET_BIND_SERVICE."""
    found = []
    pod = spec.get("securityContext", {})
    for volume in spec.get("volumes", []):
        sources = set(volume) - {"name"}
        if not sources <= RESTRICTED_VOLUMES and "hostPath" not in sources:  # hostPath: baseline's already
            found.append(f"volume {volume['name']}: {', '.join(sorted(sources))}")
    if pod.get("runAsUser") == 0:
        found.append("spec.securityContext.runAsUser 0")
    pod_profile = pod.get("seccompProfile", {}).get("type")
    for container in containers(spec):
        name, context = container["name"], container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}.securityContext.allowPrivilegeEscalation")
        non_root = context.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"{name}.securityContext.runAsNonRoot")
        if context.get("runAsUser") == 0:
            found.append(f"{name}.securityContext.runAsUser 0")
        if context.get("seccompProfile", {}).get("type", pod_profile) not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}.securityContext.seccompProfile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}.securityContext.capabilities.drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}.securityContext.capabilities.add")
    return found


def violations(spec: Spec, level: str) -> list[str]:
    """What ``pod-security.kubernetes.io/enforce: <level>`` would refuse in this pod spec ([] = admitted)."""
    if level == "privileged":
        return []
    found = baseline(spec)
    return found + restricted(spec) if level == "restricted" else found
