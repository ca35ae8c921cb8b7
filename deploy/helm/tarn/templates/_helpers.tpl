{{/* The release's resource names. */}}
{{- define "tarn.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tarn.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tarn.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end -}}

{{- define "tarn.secret" -}}
{{- default (printf "%s-credentials" (include "tarn.fullname" .)) .Values.credentials.existingSecret -}}
{{- end -}}

{{- define "tarn.headless" -}}
{{- printf "%s-headless" (include "tarn.fullname" .) -}}
{{- end -}}

{{- define "tarn.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end -}}
{{- end -}}

{{/* etcd's client endpoints: the chart's own or the given ones. */}}
{{- define "tarn.etcdEndpoints" -}}
{{- if .Values.etcd.deploy -}}
{{- $name := printf "%s-etcd" (include "tarn.fullname" .) -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "http://%s-%d.%s:2379" $name $i $name) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- required "etcd.endpoints is required when etcd.deploy is false" .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{- define "tarn.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tarn.checks" -}}
{{- if not (has .Values.mode (list "single" "cluster")) -}}
{{- fail (printf "mode must be single or cluster, not %q" .Values.mode) -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) -}}
{{- fail "tls.enabled needs tls.existingSecret (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- if and (not .Values.tls.enabled) (not .Values.tls.allowPlainHttp) -}}
{{- fail "without TLS the pods serve plain HTTP on their pod IPs: set tls.enabled (and tls.existingSecret), or tls.allowPlainHttp" -}}
{{- end -}}
{{- if and .Values.kv.hostSocketDir (not .Values.kv.enabled) -}}
{{- fail "kv.hostSocketDir is for the KV store: set kv.enabled too" -}}
{{- end -}}
{{- if and .Values.kv.hostSocketDir (not (hasPrefix "/" .Values.kv.hostSocketDir)) -}}
{{- fail "kv.hostSocketDir must be an absolute path" -}}
{{- end -}}
{{- if eq .Values.mode "cluster" -}}
{{- if lt (int .Values.replicas) (add .Values.erasure.dataShards .Values.erasure.parityShards | int) -}}
{{- fail (printf "cluster mode: %d replicas cannot hold sets of %d+%d (one drive of a set per pod)" (int .Values.replicas) (int .Values.erasure.dataShards) (int .Values.erasure.parityShards)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
