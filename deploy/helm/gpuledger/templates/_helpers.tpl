{{/* Labels on every object: the ones deploy/base sets plus Helm's. */}}
{{- define "gpuledger.labels" -}}
app.kubernetes.io/name: gpuledger
app.kubernetes.io/part-of: gpuledger
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The pods' labels, also the DaemonSet's selector (immutable once installed). */}}
{{- define "gpuledger.podLabels" -}}
app.kubernetes.io/name: gpuledger
app.kubernetes.io/component: node-agent
{{- end }}

{{- define "gpuledger.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Metrics port of a service: the config's metrics-port plus the service's offset. */}}
{{- define "gpuledger.metricsPort" -}}
{{ add (index .root.Values.config "metrics-port") .offset }}
{{- end }}

{{/* What every container has: image, env, probes on `gpuledger health <name>`, resources, security. */}}
{{- define "gpuledger.container" -}}
- name: {{ .name }}
  image: {{ include "gpuledger.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
  {{- if eq .name "nats" }}
  - nats-server
  - -a
  - 127.0.0.1
  - -p
  - '4222'
  - -js
  - -sd
  - /var/lib/gpuledger/nats
  {{- else }}
  - gpuledger
  - run
  - {{ .name }}
  ports:
  - name: {{ .portName }}
    containerPort: {{ include "gpuledger.metricsPort" . }}
    protocol: TCP
  {{- end }}
  env:
  - name: GPULEDGER_NODE_NAME
    valueFrom:
      fieldRef:
        fieldPath: spec.nodeName
  - name: GPULEDGER_CONFIG
    value: /etc/gpuledger/config.yaml
  {{- with .nvidiaCapabilities }}
  - name: NVIDIA_VISIBLE_DEVICES
    value: all
  - name: NVIDIA_DRIVER_CAPABILITIES
    value: {{ . }}
  {{- end }}
  {{- range $probe, $p := dict "startupProbe" (list 5 30) "livenessProbe" (list 30 3) "readinessProbe" (list 30 2) }}
  {{ $probe }}:
    exec:
      command:
      - gpuledger
      - health
      - {{ $.name }}
      - --timeout
      - '5'
    periodSeconds: {{ index $p 0 }}
    timeoutSeconds: 10
    failureThreshold: {{ index $p 1 }}
  {{- end }}
  resources:
    {{- toYaml .root.Values.resources | nindent 4 }}
  securityContext:
    runAsUser: 0
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop:
      - ALL
  volumeMounts:
  - name: config
    mountPath: /etc/gpuledger
    readOnly: true
  - name: tmp
    mountPath: /tmp
  {{- range .mounts }}
  - name: {{ index . 0 }}
    mountPath: {{ index . 1 }}
    {{- if gt (len .) 2 }}
    readOnly: true
    {{- end }}
  {{- end }}
{{- end }}
