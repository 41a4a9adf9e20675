{{/*
Names: everything is named after the release (no fixed names), so two releases can share a namespace.
*/}}
{{- define "ocr.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ocr.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ocr.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels shared by every pod of the release. */}}
{{- define "ocr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ocr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ocr.labels" -}}
helm.sh/chart: {{ include "ocr.chart" . }}
{{ include "ocr.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ocr-service
{{- end -}}

{{/* Pod template labels: stable across chart versions, so a chart upgrade alone does not roll a new RayCluster. */}}
{{- define "ocr.podLabels" -}}
{{ include "ocr.selectorLabels" . }}
app.kubernetes.io/part-of: ocr-service
{{- end -}}

{{- define "ocr.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ocr.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ocr.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ocr.serveServiceName" -}}{{ include "ocr.fullname" . }}-serve{{- end -}}
{{- define "ocr.redisName" -}}{{ include "ocr.fullname" . }}-redis{{- end -}}
{{- define "ocr.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "ocr.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}
{{- define "ocr.redisSecretName" -}}
{{- default (printf "%s-redis-url" (include "ocr.fullname" .)) .Values.redis.external.existingSecret -}}
{{- end -}}

{{/* Whether the limiter gets a Redis URL, and from where. */}}
{{- define "ocr.redisMode" -}}
{{- if .Values.redis.external.url -}}external
{{- else if .Values.redis.external.existingSecret -}}external
{{- else if .Values.redis.enabled -}}internal
{{- else -}}none
{{- end -}}
{{- end -}}

{{/* Largest body the service accepts (settings.max_body_bytes; Settings' default when unset). */}}
{{- define "ocr.maxBodyBytes" -}}
{{- $v := 20971520 -}}
{{- if hasKey .Values.settings "max_body_bytes" -}}{{- $v = get .Values.settings "max_body_bytes" -}}{{- end -}}
{{- int64 $v -}}
{{- end -}}

{{/*
The Serve application's `args`: settings field values (service/config.py; the builder does Settings(**args)).
User settings first, then the values the chart owns (replicas, paths, mounts), which win.
*/}}
{{- define "ocr.serveArgs" -}}
{{- $args := deepCopy .Values.settings -}}
{{- $as := .Values.autoscaling -}}
{{- /* replica counts in values are worker pods (GPUs); Serve counts engine replicas, replicasPerGpu per pod */ -}}
{{- $perGpu := int (default 1 .Values.engine.replicasPerGpu) -}}
{{- $deployment := deepCopy (default (dict) .Values.settings.engine_deployment) -}}
{{- $scaling := dict -}}
{{- if $as.enabled -}}
{{- $scaling = dict "min_replicas" (mul (int $as.minReplicas) $perGpu) "max_replicas" (mul (int $as.maxReplicas) $perGpu) "target_ongoing_requests" $as.targetOngoingRequests "upscale_delay_s" $as.upscaleDelaySeconds "downscale_delay_s" $as.downscaleDelaySeconds "look_back_period_s" $as.lookBackPeriodSeconds -}}
{{- if not (eq (toString $as.metricsIntervalSeconds) "10") -}}{{- $_ := set $scaling "metrics_interval_s" $as.metricsIntervalSeconds -}}{{- end -}}
{{- if not (kindIs "invalid" $as.initialReplicas) -}}{{- $_ := set $scaling "initial_replicas" (mul (int $as.initialReplicas) $perGpu) -}}{{- end -}}
{{- $_ := set $args "latency_target_ms" $as.latencyTargetMs -}}
{{- $_ := set $args "latency_downscale_ratio" $as.latencyDownscaleRatio -}}
{{- else -}}
{{- $scaling = dict "min_replicas" (mul (int .Values.engine.replicas) $perGpu) "max_replicas" (mul (int .Values.engine.replicas) $perGpu) -}}
{{- end -}}
{{- /* the chart's replica counts and resources win over the same keys in settings.engine_deployment */ -}}
{{- $_ := set $deployment "autoscaling_config" (merge $scaling (default (dict) $deployment.autoscaling_config)) -}}
{{- $gpus := ternary (divf 1 $perGpu) (int .Values.engine.gpusPerReplica) (gt $perGpu 1) -}}
{{- $actor := dict "num_gpus" $gpus "num_cpus" .Values.engine.rayCpusPerReplica -}}
{{- $_ := set $deployment "ray_actor_options" (merge $actor (default (dict) $deployment.ray_actor_options)) -}}
{{- with .Values.engine.maxReplicasPerNode -}}
{{- $_ := set $deployment "max_replicas_per_node" (int .) -}}
{{- end -}}
{{- $_ := set $args "engine_deployment" $deployment -}}
{{- if eq (default "embedded" .Values.settings.engine) "vllm" -}}
{{- $_ := set $args "model" .Values.model.path -}}
{{- end -}}
{{- if .Values.adapters.enabled -}}
{{- $_ := set $args "adapters_dir" .Values.adapters.path -}}
{{- end -}}
{{- if .Values.apiKeys.enabled -}}
{{- $_ := set $args "api_keys_file" (printf "%s/%s" .Values.apiKeys.mountPath .Values.apiKeys.secretKey) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* Environment of every Ray container: writable caches under /tmp (read-only root), the Redis URL secret. */}}
{{- define "ocr.rayEnv" -}}
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: {{ ternary "1" "0" .Values.rayServeThroughputOptimized | quote }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" .Values.rayServeHaProxy | quote }}
# what a replica accepts in one gRPC message in the throughput-optimized mode (Ray keeps gRPC's 4 MiB): above the
# largest request body and page of pixels, as `ocr-serve serve` sets it (service/serve/local.py)
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
  value: "335544320"
{{- if not .Values.rayServeHaProxy }}
{{- if .Values.rayServeThroughputOptimized }}
# the throughput-optimized mode turns direct ingress on, and with it and no HAProxy Serve runs its proxy on the head
# pod only: the engine pods would have nothing on port 8000 (their probes, KubeRay's Serve service)
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "0"
{{- end }}
# traffic reaches ingress replicas through the Serve proxy, not their direct-ingress ports: no 30 s hold for a
# balancer to deregister them on every scale-down and rollout (in-flight requests are still drained). HAProxy is such
# a balancer, so with it Ray's hold stays.
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: "0"
{{- end }}
# the HTTP edge (service/serve/edge.py): Serve's proxy and the ingress replicas' own ports parse HTTP with a cap on
# the request's headers and a deadline for them, read from the OCR_* variables below
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: service.serve.edge:proxy_callback
{{- if .Values.rayServeHaProxy }}
# HAProxy runs through the image's `ocr-haproxy` (service/serve/haproxy.py): the same cap and deadline, and its stats
# page and exporter bound where the API is
- name: RAY_SERVE_HAPROXY_BINARY_PATH
  value: /opt/venv/bin/ocr-haproxy
{{- end }}
{{- range $name := list "max_header_bytes" "header_timeout_s" }}
{{- if hasKey $.Values.settings $name }}
- name: OCR_{{ upper $name }}
  value: {{ index $.Values.settings $name | quote }}
{{- end }}
{{- end }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{- $mode := include "ocr.redisMode" . }}
{{- if eq $mode "internal" }}
- name: OCR_REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "ocr.redisName" .) | quote }}
{{- else if eq $mode "external" }}
- name: OCR_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ocr.redisSecretName" . }}
      key: {{ .Values.redis.external.secretKey }}
{{- end }}
{{- if .Values.logs.toStderr }}
# every Ray process writes to the container's stderr (kubectl logs), Serve replicas' loggers too: the
# throughput-optimized mode turns Serve's stderr handler off unless this is set
- name: RAY_LOG_TO_STDERR
  value: "1"
- name: RAY_SERVE_LOG_TO_STDERR
  value: "1"
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes every Ray pod mounts: /tmp (Ray session dir, caches), /dev/shm (object store, vLLM workers), keys. */}}
{{- define "ocr.commonVolumes" -}}
{{- $root := .root -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ $root.Values.tmpSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- with $root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- if $root.Values.apiKeys.enabled }}
- name: api-keys
  secret:
    secretName: {{ include "ocr.apiKeysSecretName" $root }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "ocr.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- if .Values.apiKeys.enabled }}
- name: api-keys
  mountPath: {{ .Values.apiKeys.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Ray exports `ray_ocr_*` / `ray_vllm_*`; these rename them back (= service.observability.metrics.METRIC_RELABEL_CONFIGS). */}}
{{- define "ocr.metricRelabelings" -}}
- sourceLabels: [__name__]
  regex: ray_(ocr_.+)
  targetLabel: __name__
  replacement: $1
- sourceLabels: [__name__]
  regex: ray_vllm_(.+)
  targetLabel: __name__
  replacement: vllm:$1
- action: labeldrop
  regex: otel_scope_.+
- sourceLabels: [__name__]
  regex: (ocr_|vllm:).+
  targetLabel: WorkerId
  replacement: ""
- sourceLabels: [__name__]
  regex: (ocr_|vllm:).+
  targetLabel: SessionName
  replacement: ""
{{- end -}}

{{/*
Target relabelings of the PodMonitor/ServiceMonitor: `ocr_release` = the Helm release (the operator adds `namespace`);
the alerts and dashboards group and filter by both (docs/METRICS.md, Scoping).
*/}}
{{- define "ocr.scopeRelabelings" -}}
- action: replace
  targetLabel: ocr_release
  replacement: {{ .Release.Name | quote }}
{{- end -}}


{{/* Scheduling fields of a Ray pod group (head or engine): priority, runtime class, scheduler. */}}
{{- define "ocr.podScheduling" -}}
{{- with .group.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .group.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .root.Values.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end -}}

{{- define "ocr.modelClaimName" -}}{{ include "ocr.fullname" . }}-model{{- end -}}

{{/*
The init container that downloads the weights into the model PVC. The marker holds `repo@revision` and is written
last, so an interrupted download is resumed (the hub client keeps what it fetched) and a finished one is skipped.
*/}}
{{- define "ocr.modelDownloadContainer" -}}
{{- $d := .Values.model.download -}}
- name: model-download
  image: {{ include "ocr.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - /bin/sh
    - -c
    - |
      set -eu
      marker="$MODEL_DIR/.ocr-download-complete"
      wanted="$MODEL_REPO@$MODEL_REVISION"
      if [ -f "$marker" ] && [ "$(cat "$marker")" = "$wanted" ]; then
        echo "model-download: $wanted already in $MODEL_DIR"
        exit 0
      fi
      echo "model-download: fetching $wanted into $MODEL_DIR"
      mkdir -p "$MODEL_DIR"
      python -c 'import os; from huggingface_hub import snapshot_download; snapshot_download(repo_id=os.environ["MODEL_REPO"], revision=os.environ["MODEL_REVISION"], local_dir=os.environ["MODEL_DIR"])'
      printf '%s' "$wanted" > "$marker.tmp"
      mv "$marker.tmp" "$marker"
      echo "model-download: done"
  env:
    - name: MODEL_REPO
      value: {{ $d.repo | quote }}
    - name: MODEL_REVISION
      value: {{ $d.revision | quote }}
    - name: MODEL_DIR
      value: {{ .Values.model.path | quote }}
    - name: HOME
      value: /tmp/home
    - name: HF_HOME
      value: /tmp/hf
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- with $d.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $d.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $d.tokenSecret.key }}
    {{- end }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: {{ .Values.model.mountPath }}
{{- end -}}

{{/* Environment of the batch RayJob's pods: writable caches, and the service's settings as OCR_* variables (the
driver reads them; all but strings as JSON). The engine actors get the settings from the driver. */}}
{{- define "ocr.batchEnv" -}}
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{- range $name, $value := .Values.settings }}
{{- if not (kindIs "invalid" $value) }}
- name: OCR_{{ upper $name }}
  {{- /* JSON for numbers too: toString writes a large number as 2.097152e+07 */}}
  value: {{ ternary $value (toJson $value) (kindIs "string" $value) | quote }}
{{- end }}
{{- end }}
{{- if eq (default "embedded" .Values.settings.engine) "vllm" }}
- name: OCR_MODEL
  value: {{ .Values.model.path | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The object store's credentials: every key of batch.credentialsSecret as an environment variable. */}}
{{- define "ocr.batchCredentials" -}}
{{- with .Values.batch.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end -}}
