{{/* Names, labels, and the checks that refuse impossible combinations of values. */}}

{{- define "kembed.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kembed.labels" -}}
app.kubernetes.io/name: kembed
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kembed.selector" -}}
app.kubernetes.io/name: kembed
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kembed.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "kembed.trainerImage" -}}
{{- printf "%s:%s" .Values.trainer.image.repository (.Values.trainer.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "kembed.apiUrl" -}}
{{- printf "http://%s-api.%s.svc:%d" (include "kembed.fullname" .) .Release.Namespace (int .Values.api.service.port) -}}
{{- end -}}

{{- define "kembed.adminTokenSecret" -}}
{{- .Values.api.adminToken.existingSecret | default (printf "%s-admin-token" (include "kembed.fullname" .)) -}}
{{- end -}}

{{- define "kembed.databaseSecret" -}}
{{- if eq .Values.database.type "external" -}}
{{- .Values.database.external.existingSecret -}}
{{- else -}}
{{- printf "%s-database" (include "kembed.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "kembed.databaseSecretKey" -}}
{{- if eq .Values.database.type "external" -}}{{ .Values.database.external.key }}{{- else -}}url{{- end -}}
{{- end -}}

{{- define "kembed.s3CredentialsSecret" -}}
{{- .Values.s3.credentials.existingSecret -}}
{{- end -}}

{{/* Pod-level security settings shared by every platform pod (restricted Pod Security Standard). */}}
{{- define "kembed.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kembed.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Refuse combinations that cannot work, before anything reaches the cluster. */}}
{{- define "kembed.validate" -}}
{{- if and (eq .Values.database.type "external") (not .Values.database.external.existingSecret) -}}
{{- fail "database.type=external needs database.external.existingSecret: a Secret holding the SQLAlchemy URL (postgresql+psycopg://...) under database.external.key" -}}
{{- end -}}
{{- if and (eq .Values.database.type "bundled") (gt (int .Values.api.replicas) 1) (not .Values.postgresql.persistence.enabled) -}}
{{- fail "api.replicas > 1 with the bundled PostgreSQL needs postgresql.persistence.enabled: an emptyDir database loses every job on a restart" -}}
{{- end -}}
{{- if not .Values.s3.bucket -}}
{{- fail "s3.bucket is required: checkpoints live in S3 (set s3.endpoint for MinIO or another S3-compatible store)" -}}
{{- end -}}
{{- if and .Values.s3.credentials.existingSecret .Values.s3.workloadIdentity.annotations -}}
{{- fail "s3: choose either credentials.existingSecret or workloadIdentity.annotations, not both" -}}
{{- end -}}
{{- if and (not .Values.s3.credentials.existingSecret) (not .Values.s3.workloadIdentity.annotations) -}}
{{- fail "s3: trainers need credentials: set s3.credentials.existingSecret or s3.workloadIdentity.annotations" -}}
{{- end -}}
{{- if and .Values.api.ingress.enabled (not .Values.api.ingress.host) -}}
{{- fail "api.ingress.enabled needs api.ingress.host" -}}
{{- end -}}
{{- if lt (int .Values.operator.replicas) 1 -}}
{{- fail "operator.replicas must be at least 1: without the operator no job ever starts" -}}
{{- end -}}
{{- end -}}
