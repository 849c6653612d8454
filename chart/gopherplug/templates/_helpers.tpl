{{- /*
Helpers. Every object is named after the release (fullnameOverride replaces it), and carries one
label, app.kubernetes.io/name with that name: the DaemonSet's selector, and what the PodMonitor and
examples/monitoring/podmonitor.yaml select by. No helm.sh/chart or managed-by label: the shipped
daemonset.yaml and daemonset-dra.yaml are this chart's renders, applied with kubectl as well.
*/ -}}
{{- define "gopherplug.fullname" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gopherplug.labels" -}}
app.kubernetes.io/name: {{ include "gopherplug.fullname" . }}
{{- end -}}

{{- define "gopherplug.dra" -}}
{{- if eq .Values.mode "dra" }}true{{ end -}}
{{- end -}}

{{- /*
"true" when a resource is served through the device plugin API: every resource in mode
device-plugin, those without api: dra in mode dra. Then the kubelet's device-plugins directory is
mounted and written into the configuration.
*/ -}}
{{- define "gopherplug.devicePlugin" -}}
{{- $found := not (eq .Values.mode "dra") -}}
{{- range .Values.config.resources }}{{ if ne (.api | default "device-plugin") "dra" }}{{ $found = true }}{{ end }}{{ end -}}
{{- if $found }}true{{ end -}}
{{- end -}}

{{- /*
The host directories to mount at the same path, read-only, as a JSON list: every directory of the
resources (directory, match[].directory) and extraHostPaths, in order, each once, but for /dev and
/sys and what is under them (mounted whole already).
*/ -}}
{{- define "gopherplug.hostPaths" -}}
{{- $paths := list -}}
{{- range .Values.config.resources -}}
{{- if .directory }}{{ $paths = append $paths .directory }}{{ end -}}
{{- range .match }}{{ $paths = append $paths .directory }}{{ end -}}
{{- end -}}
{{- $paths = concat $paths .Values.extraHostPaths -}}
{{- $kept := list -}}
{{- range $paths -}}
{{- $path := clean . -}}
{{- if not (or (has $path (list "/dev" "/sys")) (hasPrefix "/dev/" $path) (hasPrefix "/sys/" $path) (has $path $kept)) -}}
{{- $kept = append $kept $path -}}
{{- end -}}
{{- end -}}
{{- toJson $kept -}}
{{- end -}}

{{- /*
The CDI spec directories (spec_dir, /var/run/cdi by default) of the resources that write a CDI spec:
those with cdi, and every DRA resource (which gets one by default), as a JSON list.
*/ -}}
{{- define "gopherplug.cdiDirs" -}}
{{- $dirs := list -}}
{{- range .Values.config.resources -}}
{{- if or .cdi (eq (.api | default "device-plugin") "dra") -}}
{{- $dir := clean ((.cdi | default dict).spec_dir | default "/var/run/cdi") -}}
{{- if not (has $dir $dirs) }}{{ $dirs = append $dirs $dir }}{{ end -}}
{{- end -}}
{{- end -}}
{{- toJson $dirs -}}
{{- end -}}

{{- define "gopherplug.metricsPort" -}}
{{- .Values.metrics.port | default (ternary 9401 9400 (eq .Values.mode "dra")) -}}
{{- end -}}

{{- define "gopherplug.healthPort" -}}
{{- .Values.health.port | default (ternary 9403 9402 (eq .Values.mode "dra")) -}}
{{- end -}}

{{- define "gopherplug.serviceAccount" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "gopherplug.fullname" . }}
{{- end -}}

{{- /*
What a render says first, at the top of its first object (the ConfigMap in mode device-plugin,
the ServiceAccount in mode dra, as Helm sorts the kinds).
*/ -}}
{{- define "gopherplug.intro" -}}
{{- $dra := include "gopherplug.dra" . -}}
{{- if $dra }}
# gopherplug as a DRA driver{{ if .Values.apiLabel.enabled }} on the nodes labelled {{ .Values.apiLabel.key }}={{ .Values.apiLabel.value }}{{ end }}: its
# service account and RBAC, its configuration, the DaemonSet, an admission policy that keeps it to
# its own node's ResourceSlices, and two DeviceClasses per resource that select its devices (and
# serve pods that ask for the resource in resources.limits). Kubernetes 1.34 or later
# (resource.k8s.io/v1). docs/dra.md's "Moving a resource from the device plugin to DRA" says in what
# order to switch nodes.
{{- else }}
# gopherplug through the device plugin API{{ if .Values.apiLabel.enabled }}, on every node not switched to DRA (label
# {{ .Values.apiLabel.key }}={{ .Values.apiLabel.value }}, where a DRA release runs instead){{ end }}: a ConfigMap with
# its configuration and a DaemonSet running it.
{{- end }}
#
# Rendered from the Helm chart chart/gopherplug: the shipped daemonset.yaml and daemonset-dra.yaml
# are its renders with ci/device-plugin-values.yaml and ci/dra-values.yaml (the tests keep them
# equal). Install the chart with a values file of your own rather than edit a render:
#
#   helm install {{ include "gopherplug.fullname" . }} chart/gopherplug -n {{ .Release.Namespace }} -f my-values.yaml
#
# or apply a render as it is: build the image (`docker build{{ if $dra }} --target dra{{ end }} -t IMAGE .`, pushed where
# your nodes pull from, IMAGE in image.repository and image.tag), then `kubectl apply -f FILE`.
{{- if $dra }}
#
#   kubectl label node NODE {{ .Values.apiLabel.key }}={{ .Values.apiLabel.value }}   # the device-plugin release's pod leaves it
#   kubectl get resourceslices --field-selector spec.driver={{ .Values.dra.driver }}
#
# The node's container runtime must read CDI specs, or the pods that claim a device run without
# it and nothing reports an error: containerd 2.x and CRI-O do by default; containerd 1.7 only with
# `enable_cdi = true` and `cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]` in the
# [plugins."io.containerd.grpc.v1.cri"] section of its config.toml (check: `containerd config dump
# | grep enable_cdi` on the node); containerd 1.6 has no CDI.
#
# The image must hold the dra extra (lightkube): the Dockerfile's dra target installs
# '.[dra,metrics]', its default image only '.[metrics]'.
{{- else }}
#   kubectl get node NODE -o jsonpath='{.status.allocatable}'   # the resources appear
{{- end }}
{{- end -}}
