{{/* The release's full name, cut to the 63 characters a label or DNS name allows. */}}
{{- define "kvroute.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvroute.labels" -}}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .Values.mode }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces kubernetes discovery reads, one per line (empty: no kubernetes source). */}}
{{- define "kvroute.discoveryNamespaces" -}}
{{- $seen := dict -}}
{{- range (.Values.config.discovery | default list) -}}
{{- if eq (.kind | toString) "kubernetes" -}}
{{- $_ := set $seen (default $.Release.Namespace .namespace) true -}}
{{- end -}}
{{- end -}}
{{- range $ns, $_ := $seen }}
{{ $ns }}
{{- end -}}
{{- end -}}

{{/* gateway.yaml: the values' config with the listener the chart exposes. */}}
{{- define "kvroute.gatewayYaml" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "host" "0.0.0.0" -}}
{{- $_ := set $cfg "port" (int .Values.ports.http) -}}
{{- toYaml $cfg -}}
{{- end -}}
