{{/* The driver's image: the tag defaults to the chart's appVersion. */}}
{{- define "modelcache-csi.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The objects live in .Values.namespace: a release in another namespace
     than `default` that does not match it is a mistake worth stopping. */}}
{{- define "modelcache-csi.namespace" -}}
{{- if and (ne .Release.Namespace "default") (ne .Release.Namespace .Values.namespace) -}}
{{- fail (printf "the release's namespace is %q but the chart's objects go to %q: install with -n %s, or set --set namespace=%s" .Release.Namespace .Values.namespace .Values.namespace .Release.Namespace) -}}
{{- end -}}
{{ .Values.namespace }}
{{- end }}

{{/* The node plugin's nodeSelector as the rescheduler's --node-selector. */}}
{{- define "modelcache-csi.nodeSelectorArg" -}}
{{- $terms := list -}}
{{- range $k, $v := .Values.node.nodeSelector -}}
{{- $terms = append $terms (printf "%s=%s" $k $v) -}}
{{- end -}}
{{ join "," $terms }}
{{- end }}
