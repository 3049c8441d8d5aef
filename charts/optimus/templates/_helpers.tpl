{{/* Names are cut to 40 characters: the agents' pod hostnames add "-agents-<index>" and must
stay within a DNS label's 63. */}}
{{- define "optimus.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "optimus.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Call with (dict "root" $ "component" "redis"). */}}
{{- define "optimus.labels" -}}
{{ include "optimus.selector" .root }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "optimus.componentSelector" -}}
{{ include "optimus.selector" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The job's name, read from the job file: the agents need it (--job) before any controller
has written it to Redis. */}}
{{- define "optimus.jobName" -}}
{{- $job := fromYaml .Values.job.file -}}
{{- if hasKey $job "Error" -}}
{{- fail (printf "job.file is not YAML: %s" (get $job "Error")) -}}
{{- end -}}
{{- required "job.file must set name" (get $job "name") -}}
{{- end -}}

{{- define "optimus.redisHost" -}}
{{ include "optimus.fullname" . }}-redis
{{- end -}}

{{/* Agent <index>'s name: its Job's, its pod's hostname, its Secret's and its --node, so
that everything of one agent reads alike. Call with (list $ index). */}}
{{- define "optimus.agentName" -}}
{{ include "optimus.fullname" (index . 0) }}-agents-{{ index . 1 }}
{{- end -}}

{{/* The ACL rules of node NODE's own Redis user, password aside: the same, word for word, as
controller/store/acl.py's node_rules (tests/test_helm_chart.py compares them). Node and job
names hold no glob character. Call with (dict "job" JOB "node" NODE). */}}
{{- define "optimus.nodeRules" -}}
{{- $head := printf "optimus:{%s}:" .job -}}
resetkeys ~{{ $head }}node:{{ .node }}:* {{ range list "plan" "plan:stamp" "control" "gen:*" }}%R~{{ $head }}{{ . }} {{ end -}}
resetchannels -@all +@read +@write +@stream +@transaction +@connection -@dangerous -@scripting (~{{ $head }}commands:{{ .node }} +lpop) (&{{ $head }}wake:agents +subscribe +unsubscribe) (&{{ $head }}wake:controller +publish)
{{- end -}}

{{- define "optimus.authSecret" -}}
{{ include "optimus.fullname" . }}-redis-auth
{{- end -}}

{{- define "optimus.claim" -}}
{{ .Values.shared.existingClaim | default (printf "%s-shared" (include "optimus.fullname" .)) }}
{{- end -}}

{{/* REDIS_PASSWORD from a Secret, then REDIS_URL built from it (Kubernetes expands
$(REDIS_PASSWORD) because it is defined first). Call with (dict "root" $ "user" "controller")
for the user optimus-<user> of the release's auth Secret, or with "username" NAME, "secret" SECRET
and "key" KEY for a user whose password is elsewhere (an agent's, in its own Secret). */}}
{{- define "optimus.redisEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .secret | default (include "optimus.authSecret" .root) }}
      key: {{ .key | default (printf "%s-password" .user) }}
- name: REDIS_URL
  value: redis://{{ .username | default (printf "optimus-%s" .user) }}:$(REDIS_PASSWORD)@{{ include "optimus.redisHost" .root }}:6379/0
{{- end -}}

{{/* The job file and the shared volume, mounted at the same paths in controllers and agents:
ranks are given the job file's path by the controller and read it on their node. The root
filesystem is read-only: /tmp (the agent's sockets and its ranks' control files, torch's and
Triton's compile caches) is an emptyDir, and HOME points there for the caches kept under it. */}}
{{- define "optimus.volumeMounts" -}}
- name: job
  mountPath: /etc/optimus
  readOnly: true
- name: shared
  mountPath: {{ .Values.shared.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "optimus.volumes" -}}
- name: job
  configMap:
    name: {{ include "optimus.fullname" . }}-job
- name: shared
  persistentVolumeClaim:
    claimName: {{ include "optimus.claim" . }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "optimus.homeEnv" -}}
- name: HOME
  value: /tmp
{{- end -}}

{{/* The pod's securityContext for controllers and agents. Call with (dict "root" $ "nonRoot"
bool): false leaves the user to the image (root where it says so), for devices only root may
open; the rest of the lockdown stays. fsGroup makes the shared volume writable to the pods'
group, and OnRootMismatch spares a volume of checkpoints a recursive chown at every start. */}}
{{- define "optimus.podSecurity" -}}
runAsNonRoot: {{ .nonRoot }}
{{- if .nonRoot }}
runAsUser: {{ .root.Values.security.runAsUser }}
runAsGroup: {{ .root.Values.security.runAsGroup }}
{{- end }}
fsGroup: {{ .root.Values.security.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
{{- with .groups }}
supplementalGroups:
  {{- toYaml . | nindent 2 }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Every container of the release: no privilege escalation, no capabilities, the root
filesystem read-only, the runtime's default seccomp profile. Call with the nonRoot bool. */}}
{{- define "optimus.containerSecurity" -}}
runAsNonRoot: {{ . }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "optimus.snapshotSecret" -}}
{{ include "optimus.fullname" . }}-snapshot
{{- end -}}

{{- define "optimus.setArgs" -}}
{{- range .Values.job.set }}
- --set
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Controllers and agents exit when Redis does not answer at start; an agent's exit would
spend one of its index's retries. So their pods wait for Redis's port first. Call with
(dict "root" $ "nonRoot" bool). */}}
{{- define "optimus.waitForRedis" -}}
- name: wait-for-redis
  image: "{{ .root.Values.image.repository }}:{{ .root.Values.image.tag }}"
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  securityContext:
    {{- include "optimus.containerSecurity" .nonRoot | nindent 4 }}
  command:
    - python
    - -c
    - |
      import socket, time
      while True:
          try:
              socket.create_connection(("{{ include "optimus.redisHost" .root }}", 6379), timeout=2).close()
              break
          except OSError:
              time.sleep(2)
{{- end -}}
