{{/* Names ------------------------------------------------------------------------------- */}}
{{- define "everstep.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "everstep.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains (include "everstep.name" .) .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "everstep.name" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "everstep.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "everstep.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "everstep.apiTokenSecret" -}}
{{- default (printf "%s-api-token" (include "everstep.fullname" .)) .Values.apiToken.existingSecret -}}
{{- end -}}

{{/* The controller gets its Redis URL from a Secret (env EVERSTEP_REDIS_URL, expanded in its args)
when redis.external.existingSecret is set, so a password in it is never in a manifest */}}
{{- define "everstep.redisUrlFromSecret" -}}
{{- if and (not .Values.redis.bundled) .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "everstep.redisUrl" -}}
{{- if include "everstep.redisUrlFromSecret" . -}}
$(EVERSTEP_REDIS_URL)
{{- else if .Values.redis.bundled -}}
{{- printf "redis://%s-redis:6379/0" (include "everstep.fullname" .) -}}
{{- else -}}
{{- required "redis.external.url or redis.external.existingSecret is required when redis.bundled is false" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Labels; call with (dict "root" $ "component" "reward") ------------------------------ */}}
{{- define "everstep.selectorLabels" -}}
app.kubernetes.io/name: {{ include "everstep.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "everstep.labels" -}}
{{ include "everstep.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: everstep
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Image of a service; call with (dict "root" $ "component" "reward"). <component>.image.repository,
.tag and .digest override the global ones; a digest wins over a tag. */}}
{{- define "everstep.image" -}}
{{- $image := (index .root.Values .component).image | default dict -}}
{{- $repository := $image.repository | default (printf "%s/everstep-%s" .root.Values.image.registry .component) -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository ($image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* Annotations of a component's pods: the global podAnnotations, then the component's (which win);
call with (dict "root" $ "values" .Values.X). Renders the whole `annotations:` key, or nothing. */}}
{{- define "everstep.podAnnotations" -}}
{{- $annotations := merge (deepCopy (.values.podAnnotations | default dict)) (deepCopy (.root.Values.podAnnotations | default dict)) -}}
{{- with $annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* Pod-level fields every everstep pod shares; call with (dict "root" $ "values" .Values.X) */}}
{{- define "everstep.podCommon" -}}
serviceAccountName: {{ include "everstep.serviceAccountName" .root }}
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* How a gRPC health check is made; call with (dict "root" $ "port" N). The kubelet's grpc probe
speaks plaintext only: under mutual TLS the container checks itself with everstep.transport.health_check. */}}
{{- define "everstep.grpcProbe" -}}
{{- if .root.Values.tls.internal.enabled -}}
exec:
  command: [python, -m, everstep.transport.health_check, "127.0.0.1:{{ .port }}"]
{{- else -}}
grpc: {port: {{ .port }}}
{{- end -}}
{{- end -}}

{{/* Probes of a gRPC service (standard health service); call with (dict "root" $ "port" N) */}}
{{- define "everstep.grpcProbes" -}}
startupProbe:
  {{- include "everstep.grpcProbe" . | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 120
readinessProbe:
  {{- include "everstep.grpcProbe" . | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  {{- include "everstep.grpcProbe" . | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* Mutual TLS between services (tls.internal): env, volume and mount of every everstep container;
call with the root. Mounted outside /etc, which the sandbox binds into every run, and readable by the pod's
fsGroup only (runs have their own uid and no groups). */}}
{{- define "everstep.internalTlsEnv" -}}
{{- if .Values.tls.internal.enabled }}
- {name: EVERSTEP_GRPC_TLS_CERT, value: /var/run/secrets/everstep/tls/tls.crt}
- {name: EVERSTEP_GRPC_TLS_KEY, value: /var/run/secrets/everstep/tls/tls.key}
- {name: EVERSTEP_GRPC_TLS_CA, value: /var/run/secrets/everstep/tls/ca.crt}
- {name: EVERSTEP_GRPC_TLS_SERVER_NAME, value: {{ .Values.tls.internal.serverName | quote }}}
{{- end }}
{{- end -}}

{{- define "everstep.internalTlsVolume" -}}
{{- if .Values.tls.internal.enabled }}
- name: internal-tls
  secret:
    secretName: {{ required "tls.internal.existingSecret is required when tls.internal.enabled is true" .Values.tls.internal.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "everstep.internalTlsMount" -}}
{{- if .Values.tls.internal.enabled }}
- {name: internal-tls, mountPath: /var/run/secrets/everstep/tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* Container resources with N GPUs added to the limits; call with (dict "root" $ "values" .Values.X) */}}
{{- define "everstep.gpuResources" -}}
{{- $resources := deepCopy .values.resources -}}
{{- if gt (int .values.gpus) 0 -}}
{{- $limits := default (dict) $resources.limits -}}
{{- $_ := set $limits .root.Values.gpu.resourceName (int .values.gpus) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* env of the GPU workloads: NCCL settings, mutual TLS, then the user's extras */}}
{{- define "everstep.gpuEnv" -}}
{{- range $name, $value := .root.Values.gpu.ncclEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- include "everstep.internalTlsEnv" .root }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes of the GPU workloads */}}
{{- define "everstep.gpuVolumes" -}}
- name: tmp
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .root.Values.gpu.shmSizeLimit }}
{{- if .root.Values.sharedStorage.enabled }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-shared" (include "everstep.fullname" .root)) .root.Values.sharedStorage.existingClaim }}
{{- end }}
{{- include "everstep.internalTlsVolume" .root }}
{{- with .values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "everstep.gpuVolumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: shm, mountPath: /dev/shm}
{{- if .root.Values.sharedStorage.enabled }}
- {name: shared, mountPath: {{ .root.Values.sharedStorage.mountPath }}}
{{- end }}
{{- include "everstep.internalTlsMount" .root }}
{{- with .values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod spec of a rollout engine: used by the PodTemplate and the standing Deployment */}}
{{- define "everstep.rolloutPodSpec" -}}
{{- $v := .Values.rollout -}}
{{ include "everstep.podCommon" (dict "root" . "values" $v) }}
containers:
  - name: rollout
    image: {{ include "everstep.image" (dict "root" . "component" "rollout") }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args:
      - --host=0.0.0.0
      - --port={{ $v.port }}
      - --grpc-port={{ $v.grpcPort }}
      - --device={{ if gt (int $v.gpus) 0 }}cuda{{ else }}cpu{{ end }}
      - --dtype={{ $v.dtype }}
      - --max-running={{ $v.maxRunning }}
      - --max-seq-len={{ $v.maxSeqLen }}
      {{- with $v.extraArgs }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    env:
      {{- include "everstep.gpuEnv" (dict "root" . "values" $v) | nindent 6 }}
    ports:
      - {name: metrics, containerPort: {{ $v.port }}}
      - {name: grpc, containerPort: {{ $v.grpcPort }}}
    {{- include "everstep.grpcProbes" (dict "root" . "port" $v.grpcPort) | nindent 4 }}
    resources:
      {{- include "everstep.gpuResources" (dict "root" . "values" $v) | nindent 6 }}
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      {{- include "everstep.gpuVolumeMounts" (dict "root" . "values" $v) | nindent 6 }}
volumes:
  {{- include "everstep.gpuVolumes" (dict "root" . "values" $v) | nindent 2 }}
{{- end -}}

{{/* Pod spec of the trainer */}}
{{- define "everstep.trainerPodSpec" -}}
{{- $v := .Values.trainer -}}
{{ include "everstep.podCommon" (dict "root" . "values" $v) }}
containers:
  - name: trainer
    image: {{ include "everstep.image" (dict "root" . "component" "trainer") }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args:
      - --host=0.0.0.0
      - --port={{ $v.port }}
      - --grpc-port={{ $v.grpcPort }}
      {{- with $v.extraArgs }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    env:
      {{- include "everstep.gpuEnv" (dict "root" . "values" $v) | nindent 6 }}
    ports:
      - {name: metrics, containerPort: {{ $v.port }}}
      - {name: grpc, containerPort: {{ $v.grpcPort }}}
      - {name: rendezvous, containerPort: {{ $v.rendezvousPort }}}
    {{- include "everstep.grpcProbes" (dict "root" . "port" $v.grpcPort) | nindent 4 }}
    resources:
      {{- include "everstep.gpuResources" (dict "root" . "values" $v) | nindent 6 }}
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      {{- include "everstep.gpuVolumeMounts" (dict "root" . "values" $v) | nindent 6 }}
volumes:
  {{- include "everstep.gpuVolumes" (dict "root" . "values" $v) | nindent 2 }}
{{- end -}}

{{/* HPA; call with (dict "root" $ "component" "reward" "values" .Values.reward "kind" "Deployment") */}}
{{- define "everstep.hpa" -}}
{{- $a := .values.autoscaling -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "everstep.fullname" .root }}-{{ .component }}
  labels:
    {{- include "everstep.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "everstep.fullname" .root }}-{{ .component }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCPUUtilizationPercentage }}
    {{- with $a.extraMetrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* ClusterIP Service with the metrics and grpc ports; call with (dict "root" $ "component" "reward" "values" ...) */}}
{{- define "everstep.grpcService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "everstep.fullname" .root }}-{{ .component }}
  labels:
    {{- include "everstep.labels" . | nindent 4 }}
spec:
  selector:
    {{- include "everstep.selectorLabels" . | nindent 4 }}
  ports:
    - {name: {{ .portName | default "metrics" }}, port: {{ .values.port }}, targetPort: {{ .portName | default "metrics" }}}
    - {name: grpc, port: {{ .values.grpcPort }}, targetPort: grpc, appProtocol: grpc}
{{- end -}}

{{/* Headless Service `<fullname>-<component>-pods` of a replicated service's gRPC port: its DNS name resolves to
every ready pod, so a round-robin gRPC client (everstep.transport.balanced_channel) spreads calls over all of them,
where the ClusterIP Service would give its one connection to one pod. No metrics port: Prometheus scrapes the pods
through the ClusterIP Service once. Call like everstep.grpcService. */}}
{{- define "everstep.headlessGrpcService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "everstep.fullname" .root }}-{{ .component }}-pods
  labels:
    {{- include "everstep.labels" . | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "everstep.selectorLabels" . | nindent 4 }}
  ports:
    - {name: grpc, port: {{ .values.grpcPort }}, targetPort: grpc, appProtocol: grpc}
{{- end -}}

{{/* gRPC target of every pod of a replicated service (its headless Service), for round-robin clients; call with
(dict "root" $ "component" "reward" "values" .Values.reward) */}}
{{- define "everstep.balancedTarget" -}}
dns:///{{ include "everstep.fullname" .root }}-{{ .component }}-pods.{{ .root.Release.Namespace }}.svc:{{ .values.grpcPort }}
{{- end -}}
