{{/* The release's full name, 63 characters at most. */}}
{{- define "splitserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The namespaces the operator watches and holds Roles in, comma-joined; "" means every namespace
     (a ClusterRole), which needs operator.clusterWide: true. By default: the release's namespace. */}}
{{- define "splitserve.watchNamespaces" -}}
{{- if and .Values.operator.clusterWide .Values.operator.watchNamespaces -}}
{{- fail "operator.clusterWide: true watches every namespace: leave operator.watchNamespaces empty, or set clusterWide: false to watch only the listed namespaces" -}}
{{- end -}}
{{- if .Values.operator.watchNamespaces -}}
{{- join "," .Values.operator.watchNamespaces -}}
{{- else if not .Values.operator.clusterWide -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag -}}
{{- end -}}

{{/* The operator's defaults file: the shape of operator/settings.py's OperatorSettings. */}}
{{- define "splitserve.defaults" -}}
image:
  repository: {{ .Values.image.repository }}
  tag: {{ include "splitserve.imageTag" . | quote }}
  cudaSuffix: {{ .Values.image.cudaSuffix | quote }}
  pullPolicy: {{ .Values.image.pullPolicy }}
autoscaling:
{{ toYaml .Values.autoscaling | indent 2 }}
  plannerProfile: {{ .Values.planner.profile | quote }}
security:
  allowInsecure: {{ .Values.security.allowInsecure }}
  allowUnauthenticatedGateway: {{ .Values.security.allowUnauthenticatedGateway }}
kvCache:
{{ toYaml .Values.kvCache | indent 2 }}
flowControl:
{{ toYaml .Values.flowControl | indent 2 }}
reconcile:
  resyncSeconds: {{ .Values.operator.resyncSeconds }}
  notReadyRetrySeconds: {{ .Values.operator.notReadyRetrySeconds }}
networkPolicy:
  workloads:
{{ toYaml .Values.networkPolicy.workloads | indent 4 }}
{{- if not (hasKey .Values.networkPolicy.workloads "planner") }}
    planner:
      namespaceLabels:
        kubernetes.io/metadata.name: {{ .Release.Namespace }}
      podLabels:
        app.kubernetes.io/name: splitserve-planner
{{- end }}
{{- end -}}

{{/* What the operator may do to InferenceServices and their children (one list: ClusterRole or Roles). */}}
{{- define "splitserve.workloadRules" -}}
- apiGroups: ["serving.splitserve.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.splitserve.io"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "delete"]
# The KV secret, CA and per-pool certificates of secure-by-default services (operator/credentials.py).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Pools whose workers span nodes (spec.<pool>.nodes > 1): a LeaderWorkerSet per pool (operator/render_pods.py).
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["cert-manager.io"]
  resources: ["certificates"]
  verbs: ["get", "list", "create", "patch", "delete"]
# spec.gateway.mode inferencePool (operator/render_gateway.py).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Held only so the operator may grant it to each router's Role (RBAC forbids granting more than you hold).
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
