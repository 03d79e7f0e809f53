{{/* Names, labels and shared fragments of the gpuobj chart. */}}

{{- define "gpuobj.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release> when it contains the chart name, else <release>-<chart>; 40 characters leave room for suffixes. */}}
{{- define "gpuobj.fullname" -}}
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

{{- define "gpuobj.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "gpuobj.labels" -}}
helm.sh/chart: {{ include "gpuobj.chart" . }}
app.kubernetes.io/name: {{ include "gpuobj.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuobj
{{- end -}}

{{/* The operator pod's selector: stable across upgrades, so never add to it. */}}
{{- define "gpuobj.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuobj.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "gpuobj.operator.name" -}}
{{- printf "%s-operator" (include "gpuobj.fullname" .) -}}
{{- end -}}

{{- define "gpuobj.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpuobj.operator.name" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gpuobj.leaseName" -}}
{{- default (include "gpuobj.operator.name" .) .Values.operator.leaseName -}}
{{- end -}}

{{/*
The Secret holding the agent CA (operator/gpuobj_operator/agent_ca.py), in the release namespace.
*/}}
{{- define "gpuobj.agentCASecret" -}}
{{- default (printf "%s-agent-ca" (include "gpuobj.fullname" .)) .Values.agentTLS.caSecretName -}}
{{- end -}}

{{/*
The claim the operator writes to move its claims watch past a deletion (operator/gpuobj_operator/
progress_marker.py): its name is gpuobj_contract.names.CLAIMS_PROGRESS_MARKER (tests/e2e/deploy checks it),
in the operator's own namespace; only an operator that watches every namespace has one.
*/}}
{{- define "gpuobj.progressMarkerName" -}}
gpuobj-claims-progress
{{- end -}}

{{- define "gpuobj.progressMarkerNamespace" -}}
{{- .Release.Namespace -}}
{{- end -}}

{{- define "gpuobj.workloadRoleName" -}}
{{- printf "%s-workload" (include "gpuobj.fullname" .) -}}
{{- end -}}

{{- define "gpuobj.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
The operator's rules on workload objects: derived from operator/gpuobj_operator (reconciler.py,
free_path.py, events.py, term.py) and the informers of kube/gpuobj_kube/informer.py. Watches and lists
(one informer per kind), reads, finalizer and ownerReference patches, status patches, deletes of
objects and claims it settles, Events it posts (and patches: a repeat's count). Nothing on Secrets,
CRDs or namespaces: it watches only the kinds it names.
*/}}
{{- define "gpuobj.operator.rules" -}}
- apiGroups: [gpuobj.io]
  resources: [gpuobjects, gpuobjectclaims]
  # free: not an API verb; admission lets whoever holds it delete objects and claims that are not their own
  # (templates/admission-policy.yaml): the operator frees Lost objects and drops claims of gone holders.
  verbs: [get, list, watch, patch, delete, free]
- apiGroups: [gpuobj.io]
  resources: [gpuobjectstreams]
  verbs: [get, list, watch, patch]
- apiGroups: [gpuobj.io]
  resources: [gpuobjects/status, gpuobjectclaims/status, gpuobjectstreams/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{/* What the client library (gpuobj/client) does from a workload pod. */}}
{{- define "gpuobj.workload.rules" -}}
- apiGroups: [gpuobj.io]
  resources: [gpuobjects]
  verbs: [create, get, list, watch, delete]
- apiGroups: [gpuobj.io]
  resources: [gpuobjectclaims]
  verbs: [create, get, delete]
- apiGroups: [gpuobj.io]
  resources: [gpuobjectstreams]
  # list and watch: StreamReader follows a stream (gpuobj/client/streams.py)
  verbs: [create, get, list, watch, patch, delete]
- apiGroups: [gpuobj.io]
  resources: [gpuobjectstreams/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get]
{{- end -}}

{{/*
Admission CEL fragments (templates/admission-policy.yaml). The pod a request comes from: the API server puts
a bound token's pod name and uid in userInfo.extra; a request without extra at all (a client certificate, an
impersonation, a legacy token) has none, so every read of it is guarded by has() and yields ''.
*/}}
{{- define "gpuobj.admission.podName" -}}
has(request.userInfo.extra) && 'authentication.kubernetes.io/pod-name' in request.userInfo.extra && size(request.userInfo.extra['authentication.kubernetes.io/pod-name']) > 0 ? request.userInfo.extra['authentication.kubernetes.io/pod-name'][0] : ''
{{- end -}}

{{- define "gpuobj.admission.podUID" -}}
has(request.userInfo.extra) && 'authentication.kubernetes.io/pod-uid' in request.userInfo.extra && size(request.userInfo.extra['authentication.kubernetes.io/pod-uid']) > 0 ? request.userInfo.extra['authentication.kubernetes.io/pod-uid'][0] : ''
{{- end -}}

{{/* The requesting ServiceAccount lives in the namespace of the request (a pod name means a pod there). */}}
{{- define "gpuobj.admission.inNamespace" -}}
request.userInfo.username.startsWith('system:serviceaccount:' + request.namespace + ':')
{{- end -}}

{{/*
Who may free anything in a namespace: whoever RBAC grants the verb `free` on the resource there (the
operator's role; cluster-admin's `*`), and the garbage collector and namespace controller (owner and
namespace deletions), which are named because their roles list verbs, not `*` (system:kube-controller-manager:
the same controllers on a cluster that runs them without --use-service-account-credentials).
*/}}
{{- define "gpuobj.admission.controllers" -}}
request.userInfo.username in ['system:serviceaccount:kube-system:generic-garbage-collector', 'system:serviceaccount:kube-system:namespace-controller', 'system:kube-controller-manager']
{{- end -}}

{{- define "gpuobj.admission.finalizerRemoved" -}}
request.operation == 'UPDATE' && has(oldObject.metadata.finalizers) && 'gpuobj.io/free' in oldObject.metadata.finalizers && !(has(object.metadata.finalizers) && 'gpuobj.io/free' in object.metadata.finalizers)
{{- end -}}

{{/*
A byte quantity as the operator's flags take it: a string as written (8Gi), a number as a whole number
(YAML numbers reach templates as floats, which would print as 8.589934592e+09).
*/}}
{{- define "gpuobj.bytes" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}
