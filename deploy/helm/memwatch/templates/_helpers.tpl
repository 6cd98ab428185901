{{/* The workload's name: fullnameOverride, else the release's name. */}}
{{- define "memwatch.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "memwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "memwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "memwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end -}}

{{- define "memwatch.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "memwatch.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "memwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "memwatch.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* <registry>/<repository>:<tag>, or @<digest> when one is given. */}}
{{- define "memwatch.image" -}}
{{- $prefix := ternary "" (printf "%s/" (trimSuffix "/" .registry)) (empty .registry) -}}
{{- if .digest -}}
{{- printf "%s%s@%s" $prefix .repository .digest -}}
{{- else -}}
{{- printf "%s%s:%s" $prefix .repository .tag -}}
{{- end -}}
{{- end -}}

{{/* The rings directory inside every container (the agent's is below its hostPath runtime directory). */}}
{{- define "memwatch.ringsDir" -}}/run/memwatch/rings{{- end -}}

{{/* The uids whose rings memwatch stores: trust.uids, and in sidecar mode the engine's own uid (root when unset). */}}
{{- define "memwatch.trustUids" -}}
{{- $uids := list -}}
{{- if eq .Values.mode "sidecar" -}}
{{- $uids = append $uids (int (default 0 .Values.engine.runAsUser)) -}}
{{- end -}}
{{- range .Values.trust.uids -}}
{{- $uids = append $uids (int .) -}}
{{- end -}}
{{- $uids | uniq | toJson -}}
{{- end -}}

{{/* memwatch serve's arguments, one per line as a YAML list. */}}
{{- define "memwatch.serveArgs" -}}
{{- if and (eq .Values.retention.keepRollups "forever") (has (toString .Values.retention.maxDbSize) (list "" "0")) }}
{{- fail "retention.keepRollups=forever with no retention.maxDbSize: the database would grow for ever (and an emptyDir past its sizeLimit evicts the pod): set retention.maxDbSize" }}
{{- end }}
{{- $agent := eq .Values.mode "agent" -}}
- serve
- --runtime-dir={{ include "memwatch.ringsDir" . }}
{{- if $agent }}
- --state-dir=/run/memwatch/state
{{- end }}
- --runtime-group={{ ternary .Values.trust.nodeGroup .Values.trust.sidecarGroup $agent }}
{{- range (include "memwatch.trustUids" . | fromJsonArray) }}
- --trust-uid={{ . }}
{{- end }}
- --db=/var/lib/memwatch/memwatch.db
- --keep-full={{ .Values.retention.keepFull }}
- --keep-evidence={{ .Values.retention.keepEvidence }}
{{- with .Values.retention.keepRollups }}
- --keep-rollups={{ . }}
{{- end }}
{{- with .Values.retention.maxDbSize }}
- --max-db-size={{ . }}
{{- end }}
{{- if not (kindIs "invalid" .Values.memwatch.pollInterval) }}
- --poll-interval={{ .Values.memwatch.pollInterval }}
{{- end }}
{{- if .Values.exporters.prometheus.enabled }}
- --prometheus=0.0.0.0:{{ .Values.exporters.prometheus.port }}
{{- end }}
{{- if .Values.exporters.otlp.enabled }}
- {{ printf "--otlp%s" (ternary "" (printf "=%s" .Values.exporters.otlp.endpoint) (empty .Values.exporters.otlp.endpoint)) | quote }}
{{- end }}
- --health=0.0.0.0:{{ .Values.memwatch.healthPort }}
{{- range .Values.memwatch.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* memwatch's container ports. */}}
{{- define "memwatch.ports" -}}
{{- if .Values.exporters.prometheus.enabled }}
- name: metrics
  containerPort: {{ .Values.exporters.prometheus.port }}
{{- end }}
- name: health
  containerPort: {{ .Values.memwatch.healthPort }}
{{- end -}}

{{/* memwatch's container security context: nothing added, everything dropped, read-only root. */}}
{{- define "memwatch.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The engine's downward-API names, which memwatch records as the pod's identity. */}}
{{- define "memwatch.engineEnv" -}}
- name: MEMWATCH
  value: "1"
- name: MEMWATCH_SPAWN
  value: "0"
- name: MEMWATCH_RUNTIME_DIR
  value: {{ include "memwatch.ringsDir" . }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: CONTAINER_NAME
  value: vllm
{{- end -}}

{{/* The engine's arguments after the image's ENTRYPOINT ["vllm", "serve"]: the model first. */}}
{{- define "memwatch.engineArgs" -}}
{{- prepend .Values.engine.args .Values.engine.model | toJson -}}
{{- end -}}

{{- define "memwatch.podCommon" -}}
serviceAccountName: {{ include "memwatch.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with ternary .Values.agent.priorityClassName .Values.priorityClassName (eq .Values.mode "agent") }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The memwatch container's environment: MEMWATCH_BUNDLE_TO when bundles.to is set, then memwatch.env.
     Called with the root context, or with (dict "root" . "grace" SECONDS) where the container is the first of its
     pod to be told to stop (the agent): its shutdown may then use the pod's whole terminationGracePeriodSeconds
     (MEMWATCH_GRACE_PERIOD). A native sidecar is told after the engine has stopped, so it keeps the default. */}}
{{- define "memwatch.env" -}}
{{- $root := .root | default . -}}
{{- $grace := .grace -}}
{{- if or $root.Values.memwatch.env $root.Values.bundles.to $grace }}
env:
  {{- with $grace }}
  - name: MEMWATCH_GRACE_PERIOD
    value: {{ . | quote }}
  {{- end }}
  {{- with $root.Values.bundles.to }}
  - name: MEMWATCH_BUNDLE_TO
    value: {{ . | quote }}
  {{- end }}
  {{- with $root.Values.memwatch.env }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The memwatch container of the sidecar shape (its name and restartPolicy are set by the caller). */}}
{{- define "memwatch.sidecarContainer" -}}
image: {{ include "memwatch.image" .Values.image.memwatch }}
imagePullPolicy: {{ .Values.image.memwatch.pullPolicy }}
args:
  {{- include "memwatch.serveArgs" . | nindent 2 }}
{{- include "memwatch.env" . }}
ports:
  {{- include "memwatch.ports" . | trim | nindent 2 }}
startupProbe:
  httpGet:
    path: /readyz
    port: {{ .Values.memwatch.healthPort }}
  periodSeconds: {{ .Values.memwatch.startupProbe.periodSeconds }}
  failureThreshold: {{ .Values.memwatch.startupProbe.failureThreshold }}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .Values.memwatch.healthPort }}
  periodSeconds: {{ .Values.memwatch.livenessProbe.periodSeconds }}
  failureThreshold: {{ .Values.memwatch.livenessProbe.failureThreshold }}
lifecycle:
  preStop:
    # Runs once the engine has exited (native sidecar) or beside its SIGTERM (ordinary container): waits, at
    # most drainSeconds, until every ring is stored and removed; SIGTERM then makes memwatch drain the rest.
    exec:
      command: ["sh", "-c", "for i in $(seq 1 {{ .Values.memwatch.drainSeconds }}); do ls {{ include "memwatch.ringsDir" . }}/*.ring >/dev/null 2>&1 || exit 0; sleep 1; done"]
securityContext:
  runAsUser: {{ .Values.trust.sidecarUid }}
  runAsGroup: {{ .Values.trust.sidecarGroup }}
  runAsNonRoot: true
  {{- include "memwatch.containerSecurityContext" . | nindent 2 }}
{{- with .Values.memwatch.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  {{- include "memwatch.memwatchMounts" . | nindent 2 }}
{{- end -}}

{{/* The mount paths memwatch.extraVolumeMounts gives, as a JSON list: the chart's own mount there is left out. */}}
{{- define "memwatch.extraPaths" -}}
{{- $paths := list -}}
{{- range .Values.memwatch.extraVolumeMounts -}}
{{- $paths = append $paths (.mountPath | trimSuffix "/") -}}
{{- end -}}
{{- $paths | toJson -}}
{{- end -}}

{{/* memwatch's mounts: the runtime directory, the database and /tmp (read-only root) unless
memwatch.extraVolumeMounts mounts something at that path instead, then memwatch.extraVolumeMounts. */}}
{{- define "memwatch.memwatchMounts" -}}
{{- $agent := eq .Values.mode "agent" -}}
{{- $paths := include "memwatch.extraPaths" . | fromJsonArray -}}
- name: {{ ternary "runtime" "memwatch-run" $agent }}
  mountPath: /run/memwatch
{{- if not (has "/var/lib/memwatch" $paths) }}
- name: {{ ternary "db" "memwatch-db" $agent }}
  mountPath: /var/lib/memwatch
{{- end }}
{{- if not (has "/tmp" $paths) }}
- name: memwatch-tmp
  mountPath: /tmp
{{- end }}
{{- with .Values.memwatch.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* /tmp for memwatch's read-only root (unless memwatch.extraVolumeMounts mounts one), then extraVolumes. */}}
{{- define "memwatch.extraVolumes" -}}
{{- if and (ne .Values.mode "engine") (not (has "/tmp" (include "memwatch.extraPaths" . | fromJsonArray))) }}
- name: memwatch-tmp
  emptyDir:
    sizeLimit: {{ .Values.memwatch.tmpSizeLimit }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The engine container's securityContext: Pod Security "restricted" (runAsNonRoot with a non-root uid; vLLM's
image runs as root when engine.runAsUser is unset), then engine.securityContext merged over it. The uid and group
are the container's in the sidecar shape (memwatch has its own); the engine pod sets them on the pod. */}}
{{- define "memwatch.engineSecurityContext" -}}
{{- $context := dict "allowPrivilegeEscalation" false "capabilities" (dict "drop" (list "ALL"))
      "seccompProfile" (dict "type" "RuntimeDefault") -}}
{{- $uid := .Values.engine.runAsUser -}}
{{- $sidecar := eq .Values.mode "sidecar" -}}
{{- if not (kindIs "invalid" $uid) -}}
{{- if $sidecar }}{{ $_ := set $context "runAsUser" (int64 $uid) }}{{ end -}}
{{- if gt (int64 $uid) 0 }}{{ $_ := set $context "runAsNonRoot" true }}{{ end -}}
{{- end -}}
{{- if and $sidecar (not (kindIs "invalid" .Values.engine.runAsGroup)) -}}
{{- $_ := set $context "runAsGroup" (int64 .Values.engine.runAsGroup) -}}
{{- end -}}
{{- mergeOverwrite $context (deepCopy .Values.engine.securityContext) | toYaml -}}
{{- end -}}

{{/* Milliseconds of a Prometheus duration (1m30s, 500ms): checks that scrapeTimeout does not exceed interval. */}}
{{- define "memwatch.durationMs" -}}
{{- $scale := dict "y" 31536000000 "w" 604800000 "d" 86400000 "h" 3600000 "m" 60000 "s" 1000 "ms" 1 -}}
{{- $total := 0 -}}
{{- range regexFindAll "[0-9]+(ms|y|w|d|h|m|s)" . -1 -}}
{{- $total = add $total (mul (regexFind "^[0-9]+" . | int64) (get $scale (regexFind "[a-z]+$" .))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/* A monitor's endpoint fields after port and path; fails when both monitors are on or scrapeTimeout > interval. */}}
{{- define "memwatch.monitorEndpoint" -}}
{{- $root := index . 0 -}}
{{- $monitor := index . 1 -}}
{{- if and $root.Values.monitoring.serviceMonitor.enabled $root.Values.monitoring.podMonitor.enabled }}
{{- fail "monitoring.serviceMonitor and monitoring.podMonitor are both enabled: they scrape the same port twice; enable one" }}
{{- end }}
{{- if not $root.Values.exporters.prometheus.enabled }}
{{- fail "monitoring.serviceMonitor and monitoring.podMonitor need exporters.prometheus.enabled" }}
{{- end }}
{{- if and $monitor.interval $monitor.scrapeTimeout }}
{{- if gt (include "memwatch.durationMs" $monitor.scrapeTimeout | int64) (include "memwatch.durationMs" $monitor.interval | int64) }}
{{- fail (printf "monitoring: scrapeTimeout %s exceeds interval %s, which Prometheus refuses" $monitor.scrapeTimeout $monitor.interval) }}
{{- end }}
{{- end }}
{{- with $monitor.interval }}
interval: {{ . | quote }}
{{- end }}
{{- with $monitor.scrapeTimeout }}
scrapeTimeout: {{ . | quote }}
{{- end }}
honorLabels: true
{{- with $monitor.relabelings }}
relabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $monitor.metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The Pod Security level the namespace needs: privileged for hostPath (agent, engine); sidecar: restricted with a
non-root engine, else baseline (vLLM's image runs as root). */}}
{{- define "memwatch.podSecurity" -}}
{{- $nonRoot := and (not (kindIs "invalid" .Values.engine.runAsUser)) (gt (int64 (default 0 .Values.engine.runAsUser)) 0) -}}
{{- $sidecar := ternary "restricted" "baseline" $nonRoot -}}
{{- .Values.namespace.podSecurity | default (ternary $sidecar "privileged" (eq .Values.mode "sidecar")) -}}
{{- end -}}

{{/* The metrics Service: the agent's own name; beside an engine, <name>-memwatch. */}}
{{- define "memwatch.metricsService" -}}
{{- if eq .Values.mode "agent" -}}
{{- include "memwatch.fullname" . -}}
{{- else -}}
{{- printf "%s-memwatch" (include "memwatch.fullname" . | trunc 54 | trimSuffix "-") -}}
{{- end -}}
{{- end -}}

{{/* The database's bound and its arithmetic, as a comment in the rendered manifest. */}}
{{- define "memwatch.boundComment" -}}
{{- $r := .Values.retention -}}
# - Database bound: {{ .Values.storage.retentionBound }} under --keep-full={{ $r.keepFull }} --keep-evidence={{ $r.keepEvidence }} --keep-rollups={{ $r.keepRollups }}
{{- with $r.maxDbSize }} --max-db-size={{ . }}{{ end }}
#   For R ranks at S steps/s (bench/bench_retention.py measures 118 B a full-resolution row, 238 B a per-second
#   roll-up row, indexes included): R x (S x 118 B x (keep-full + 241 s a flag or OOM) + 238 B x keep-rollups);
#   8 ranks x 100 steps/s: 0.34 GB at full resolution + 0.33 GB of roll-ups = 0.67 GB, plus 22.7 MB a flag or OOM.
#   Flags have no fixed rate, so --max-db-size caps the pages in use: the bound is the cap, plus one 30 s pass of
#   inflow (2.8 MB) and SQLite's write-ahead log (at most one rank-hour, 42 MB): 1.55 GB with a 1500MB cap.
{{- end -}}
