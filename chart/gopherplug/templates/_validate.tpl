{{- /*
What `gopherplug serve` would refuse at start, refused at `helm template`/`install` instead: a
DaemonSet takes a values file to every node at once, and a configuration the plugin refuses there
crash-loops the whole pool. Each check is one of parse_config's (gopherplug.py), with its sentence,
at the key's path in the values ("config.resources[0].env: ..."); the test
test_every_refusal_of_parse_config_is_refused_at_render keeps the two lists together (a refusal
that needs the node, a device or PATH, is named there with the reason); and the checks that return
their problem rather than fail (gopherplug.resourceNameProblem, declaredProblem, countProblem) are
held to parse_config's verdict on values generated either side of every limit, in one render of a
test chart each (test_the_chart_and_parse_config_agree_on_every_attribute_and_capacity and the
tests beside it). values.schema.json keeps
the checks whose Helm line is readable as it is (types, unknown keys, ranges, enums); a pattern or
a `not` there would print a regex or "'not' failed", so those are here, as sentences.

gopherplug.warnings: what check-config warns about, one line each, which NOTES.txt prints.
*/ -}}
{{- define "gopherplug.validate" -}}
{{- $v := .Values -}}
{{- $dns := "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" -}}
{{- $qualified := "^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" -}}
{{- $dra := eq $v.mode "dra" -}}
{{- /* Values outside config: paths, and names the chart writes into objects. */ -}}
{{- if not (hasPrefix "/" $v.kubeletDir) }}{{ fail (printf "kubeletDir: '%s' must be an absolute path" $v.kubeletDir) }}{{ end -}}
{{- $pluginDir := printf "%s/device-plugins" (clean $v.kubeletDir) -}}
{{- $longest := len (printf "%s/gopherplug-0000000000000000-9999.sock" $pluginDir) -}}
{{- if and (include "gopherplug.devicePlugin" .) (gt $longest 107) -}}
{{- fail (printf "kubeletDir: '%s' is %d characters long: a socket path in it would pass the 107 bytes unix sockets allow; use a directory of at most %d characters" $pluginDir (len $pluginDir) (sub 107 (sub $longest (len $pluginDir)))) -}}
{{- end -}}
{{- if and $v.nfd.enabled (not (hasPrefix "/" $v.nfd.featuresDir)) -}}
{{- fail (printf "nfd.featuresDir: '%s' must be an absolute path" $v.nfd.featuresDir) -}}
{{- end -}}
{{- range $i, $path := $v.extraHostPaths -}}
{{- if not (hasPrefix "/" $path) }}{{ fail (printf "extraHostPaths[%d]: '%s' must be an absolute path" $i $path) }}{{ end -}}
{{- end -}}
{{- if not (regexMatch "^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$" $v.fullnameOverride) -}}
{{- fail (printf "fullnameOverride: '%s': must be a lower-case DNS label of at most 63 characters (letters, digits, '-'), e.g. gopherplug-gpu" $v.fullnameOverride) -}}
{{- end -}}
{{- if and $v.apiLabel.enabled (or (gt (len $v.apiLabel.value) 63) (not (regexMatch "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$" $v.apiLabel.value))) -}}
{{- fail (printf "apiLabel.value: '%s': must be a label value, at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit, e.g. dra" $v.apiLabel.value) -}}
{{- end -}}
{{- if not (regexMatch "^([0-9]+(ms|s|m|h))+$" $v.podMonitor.interval) -}}
{{- fail (printf "podMonitor.interval: '%s': must be a duration Prometheus reads, e.g. 30s, 1m or 1m30s" $v.podMonitor.interval) -}}
{{- end -}}
{{- if $dra -}}
{{- $driver := $v.dra.driver -}}
{{- if or (not (regexMatch $dns $driver)) (gt (len $driver) 63) -}}
{{- fail (printf "dra.driver: '%s': must be a lower-case DNS subdomain of at most 63 characters, e.g. gopherplug.example.com" $driver) -}}
{{- end -}}
{{- range list (printf "%s/plugins_registry/%s-reg.sock" (clean $v.kubeletDir) $driver) (printf "%s/plugins/%s/dra.sock" (clean $v.kubeletDir) $driver) -}}
{{- if gt (len .) 107 }}{{ fail (printf "dra: the socket %s would pass the 107 bytes unix sockets allow: choose a shorter driver name" .) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- range $i, $class := $v.dra.extraDeviceClasses -}}
{{- if or (gt (len $class.name) 253) (not (regexMatch $dns $class.name)) -}}
{{- fail (printf "dra.extraDeviceClasses[%d].name: '%s': must be a lower-case DNS subdomain of at most 253 characters, e.g. gpu-large.example.com" $i $class.name) -}}
{{- end -}}
{{- end -}}
{{- /* The resources, one by one: parse_config's _parse_resource and what it calls. */ -}}
{{- $mounted := include "gopherplug.hostPaths" . | fromJsonArray -}}
{{- $hasDra := false -}}
{{- range $i, $r := $v.config.resources -}}
{{- $at := printf "config.resources[%d]" $i -}}
{{- $name := $r.name | toString -}}
{{- /* toYaml writes "" for what Go's YAML cannot write (DEL, C1 controls, U+FFFE): the resource
would reach the node as its name alone, and be refused there. */ -}}
{{- if not (toYaml (omit $r "name")) -}}
{{- fail (printf "%s: has a character toYaml cannot write into the ConfigMap (DEL, a C1 control character, U+FFFE): remove it" $at) -}}
{{- end -}}
{{- /* Every string the ConfigMap carries must reach the node as a string (attributes and capacity: declaredProblem). */ -}}
{{- with include "gopherplug.textProblem" (dict "at" $at "value" (omit $r "name" "attributes" "capacity")) }}{{ fail . }}{{ end -}}
{{- $parts := splitList "/" $name -}}
{{- $problem := include "gopherplug.resourceNameProblem" $name -}}
{{- if $problem }}{{ fail (printf "%s.name: '%s': %s" $at $name $problem) }}{{ end -}}
{{- /* api: the chart writes dra (the driver) in mode dra only. */ -}}
{{- $api := $r.api | default "device-plugin" -}}
{{- if eq $api "dra" -}}
{{- $hasDra = true -}}
{{- if not $dra }}{{ fail (printf "%s.api: dra needs the DRA driver: set mode: dra (a release of its own; this one is mode device-plugin)" $at) }}{{ end -}}
{{- if gt (len $name) 64 }}{{ fail (printf "%s.name: with api: dra, the name is a device attribute: at most 64 characters" $at) }}{{ end -}}
{{- end -}}
{{- /* Where the devices are: directory and pattern, or match, or usb (_parse_sources). */ -}}
{{- $directories := list -}}
{{- $sources := list -}}
{{- if hasKey $r "match" -}}
{{- range $key := list "directory" "pattern" -}}
{{- if hasKey $r $key }}{{ fail (printf "%s.%s: goes in a match entry when match is given (directory and pattern are a match of one)" $at $key) }}{{ end -}}
{{- end -}}
{{- range $j, $m := $r.match -}}
{{- if not (hasPrefix "/" $m.directory) }}{{ fail (printf "%s.match[%d].directory: '%s' must be an absolute path" $at $j $m.directory) }}{{ end -}}
{{- $source := dict "directory" (clean $m.directory) "pattern" ($m.pattern | default "*") "at" (printf "%s.match[%d]" $at $j) "given" (hasKey $m "pattern") -}}
{{- range $k, $earlier := $sources -}}
{{- if and (eq $earlier.directory $source.directory) (eq $earlier.pattern $source.pattern) }}{{ fail (printf "%s.match[%d]: repeats match[%d]" $at $j $k) }}{{ end -}}
{{- end -}}
{{- $sources = append $sources $source -}}
{{- $directories = append $directories (clean $m.directory) -}}
{{- end -}}
{{- else if hasKey $r "directory" -}}
{{- if not (hasPrefix "/" $r.directory) }}{{ fail (printf "%s.directory: '%s' must be an absolute path" $at $r.directory) }}{{ end -}}
{{- $sources = list (dict "directory" (clean $r.directory) "pattern" ($r.pattern | default "*") "at" $at "given" (hasKey $r "pattern")) -}}
{{- $directories = list (clean $r.directory) -}}
{{- else if hasKey $r "pattern" -}}
{{- fail (printf "%s.pattern: names entries of a directory: give directory too" $at) -}}
{{- end -}}
{{- range $j, $u := $r.usb -}}
{{- range $key := list "vendor" "product" -}}
{{- $id := get $u $key -}}
{{- if or (not (kindIs "string" $id)) (not (regexMatch "^[0-9A-Fa-f]{4}$" (toString $id))) -}}
{{- fail (printf "%s.usb[%d].%s: %v: must be 4 hex digits in quotes, as lsusb prints them (e.g. \"0407\")" $at $j $key $id) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (not $directories) (not $r.usb) -}}
{{- fail (printf "%s.directory: is required, unless match or usb says where the devices are" $at) -}}
{{- end -}}
{{- if and $r.usb $directories -}}
{{- fail (printf "%s.usb: and %s in one resource would offer both kinds of device as one list: give the USB devices a resource of their own" $at (ternary "match" "directory" (hasKey $r "match"))) -}}
{{- end -}}
{{- if hasKey $r "id_pattern" -}}
{{- if not $directories }}{{ fail (printf "%s.id_pattern: names directory entries, and this resource has none: a USB device's ID is its serial or port" $at) }}{{ end -}}
{{- if not (contains "(?P<id>" $r.id_pattern) }}{{ fail (printf "%s.id_pattern: '%s' has no group named id: mark the part of the name that is the ID with (?P<id>...)" $at $r.id_pattern) }}{{ end -}}
{{- end -}}
{{- /* env: the variable each container gets; the default is made from the name (default_env_name). */ -}}
{{- $short := regexReplaceAll "[^A-Z0-9_]" (upper (last $parts)) "_" -}}
{{- $env := $r.env | default (printf "%s%s_DEVICES" (ternary "_" "" (regexMatch "^[0-9]" $short)) $short) | toString -}}
{{- $unsafe := list "GCONV_PATH" "GETCONF_DIR" "HOSTALIASES" "LOCALDOMAIN" "LOCPATH" "MALLOC_TRACE" "NIS_PATH" "NLSPATH" "RESOLV_HOST_CONF" "RES_OPTIONS" "TMPDIR" "TZDIR" "PATH" "HOME" "SHELL" "IFS" "ENV" "BASH_ENV" "CDPATH" "SHELLOPTS" "BASHOPTS" "PS4" "GLOBIGNORE" "PWD" "OLDPWD" -}}
{{- if not (regexMatch "^[A-Za-z_][A-Za-z0-9_]*$" $env) }}{{ fail (printf "%s.env: '%s' is not a valid environment variable name" $at $env) }}{{ end -}}
{{- if or (hasPrefix "LD_" $env) (has $env $unsafe) -}}
{{- if hasKey $r "env" -}}
{{- fail (printf "%s.env: '%s' is given meaning by the shell or the dynamic loader: choose another name" $at $env) -}}
{{- else -}}
{{- fail (printf "%s.env: '%s', the default for '%s', is given meaning by the shell or the dynamic loader: set env" $at $env $name) -}}
{{- end -}}
{{- end -}}
{{- if eq $env "GOPHERPLUG_RESOURCE" }}{{ fail (printf "%s.env: '%s' is set by gopherplug for pre_start: choose another name" $at $env) }}{{ end -}}
{{- /* allowed_host_paths: each must be mounted into the pod, or the plugin sees nothing there. */ -}}
{{- range $j, $path := $r.allowed_host_paths -}}
{{- $where := printf "%s.allowed_host_paths[%d]" $at $j -}}
{{- if not (hasPrefix "/" $path) }}{{ fail (printf "%s: '%s' must be an absolute path" $where $path) }}{{ end -}}
{{- if eq (clean $path) "/" }}{{ fail (printf "%s: '/' would allow every host path: list the directories you need" $where) }}{{ end -}}
{{- $in := or (eq (clean $path) "/dev") (eq (clean $path) "/sys") (hasPrefix "/dev/" (clean $path)) (hasPrefix "/sys/" (clean $path)) -}}
{{- range $mounted }}{{ if or (eq (clean $path) .) (hasPrefix (printf "%s/" .) (clean $path)) }}{{ $in = true }}{{ end }}{{ end -}}
{{- if not $in -}}
{{- fail (printf "%s: '%s' is not mounted into the plugin's pod, which would see nothing there: add it to extraHostPaths" $where $path) -}}
{{- end -}}
{{- end -}}
{{- /* A whole /dev, read-write, never by a default pattern. */ -}}
{{- $everything := "" -}}
{{- range $sources -}}
{{- if and (not $everything) (eq .directory "/dev") (eq (trimAll "*" .pattern) "") -}}
{{- $everything = printf "%s.pattern: '%s'%s in /dev offers every entry there read-write, disks, kmsg and mem among them: name the devices (e.g. 'ttyUSB*'), or set whole_dev: true" .at .pattern (ternary "" " (the default)" .given) -}}
{{- end -}}
{{- end -}}
{{- if and $everything (not $r.whole_dev) }}{{ fail $everything }}{{ end -}}
{{- if and $r.whole_dev (not $everything) }}{{ fail (printf "%s.whole_dev: is for a pattern that matches every entry of /dev, and this resource has none: remove it" $at) }}{{ end -}}
{{- /* device_specs and mounts: host paths within the resource's directories, allowed_host_paths and /dev. */ -}}
{{- $inDev := not (empty $r.usb) -}}
{{- range $directories }}{{ if or (eq . "/dev") (hasPrefix "/dev/" .) }}{{ $inDev = true }}{{ end }}{{ end -}}
{{- $roots := list -}}
{{- range concat $directories ($r.allowed_host_paths | default list) (ternary (list "/dev") list $inDev) -}}
{{- if not (has (clean .) $roots) }}{{ $roots = append $roots (clean .) }}{{ end -}}
{{- end -}}
{{- $fields := list "id" "path" "name" "target" "index" -}}
{{- $templates := list -}}
{{- range $j, $spec := $r.device_specs }}{{ $templates = append $templates (dict "at" (printf "%s.device_specs[%d]" $at $j) "entry" $spec) }}{{ end -}}
{{- range $j, $mount := $r.mounts }}{{ $templates = append $templates (dict "at" (printf "%s.mounts[%d]" $at $j) "entry" $mount) }}{{ end -}}
{{- range $templates -}}
{{- $where := .at -}}
{{- $entry := .entry -}}
{{- range $key := list "host_path" "container_path" -}}
{{- $template := get $entry $key | toString -}}
{{- $used := list -}}
{{- $bare := $template | replace "{{" "" | replace "}}" "" -}}
{{- range regexFindAll "\\{[^{}]*\\}" $bare -1 -}}
{{- $field := trimPrefix "{" . | trimSuffix "}" -}}
{{- if not (has $field $fields) }}{{ fail (printf "%s.%s: '%s': bad placeholder (%s); use {id}, {path}, {name}, {target} or {index}" $where $key $template .) }}{{ end -}}
{{- $used = append $used $field -}}
{{- end -}}
{{- if regexMatch "[{}]" (regexReplaceAll "\\{[^{}]*\\}" $bare "") }}{{ fail (printf "%s.%s: '%s': bad placeholder (a single '{' or '}'); use {id}, {path}, {name}, {target} or {index}" $where $key $template) }}{{ end -}}
{{- if not (or (hasPrefix "/" $template) (hasPrefix "{path}" $template) (hasPrefix "{target}" $template)) }}{{ fail (printf "%s.%s: '%s' must be an absolute path" $where $key $template) }}{{ end -}}
{{- if eq $key "host_path" -}}
{{- if has "index" $used }}{{ fail (printf "%s.host_path: '%s': a host path can use {id}, {path}, {name} and {target}, not {index}" $where $template) }}{{ end -}}
{{- $under := false -}}
{{- range $roots }}{{ if or (eq (clean $template) .) (hasPrefix (printf "%s/" (trimSuffix "/" .)) (clean $template)) }}{{ $under = true }}{{ end }}{{ end -}}
{{- if and (not $used) (not $under) -}}
{{- fail (printf "%s.host_path: '%s' is outside %s: add its directory to allowed_host_paths" $where $template (join ", " $roots)) -}}
{{- end -}}
{{- else if and (has "index" $used) (or $r.cdi (eq $api "dra")) -}}
{{- fail (printf "%s.container_path: '%s': with cdi, a device is described once, not per allocation: use {id} instead of {index}" $where $template) -}}
{{- end -}}
{{- end -}}
{{- if hasKey .entry "permissions" -}}
{{- $permissions := .entry.permissions | toString -}}
{{- if or (not (regexMatch "^[rwm]+$" $permissions)) (ne (len $permissions) (len (uniq (splitList "" $permissions)))) -}}
{{- fail (printf "%s.permissions: '%s': use letters from r, w and m, each once" $where $permissions) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* annotations: keys as Kubernetes validates them, values per device. */ -}}
{{- range $key, $value := $r.annotations -}}
{{- $where := printf "%s.annotations.%s" $at $key -}}
{{- range regexFindAll "\\{[^{}]*\\}" $key -1 -}}
{{- if not (has . (list "{id}" "{index}")) }}{{ fail (printf "%s: a key can use {id} and {index}, not a path or name" $where) }}{{ end -}}
{{- end -}}
{{- $sample := $key | replace "{id}" "gopher0" | replace "{index}" "0" -}}
{{- $keyName := last (splitList "/" $sample) -}}
{{- $prefix := trimSuffix (printf "/%s" $keyName) $sample -}}
{{- if or (gt (len (splitList "/" $sample)) 2) (not (regexMatch $qualified $keyName)) (gt (len $keyName) 63) (and (ne $prefix $sample) (not (regexMatch $dns $prefix))) -}}
{{- fail (printf "%s: not a valid annotation key: [prefix/]name, a name of at most 63 letters, digits, '-', '_', '.'" $where) -}}
{{- end -}}
{{- if regexMatch "\\{(name|target)\\}" (toString $value) -}}
{{- fail (printf "%s: '%s': an annotation is per device, not per entry: use {id}, {path} or {index}" $where $value) -}}
{{- end -}}
{{- end -}}
{{- /* cdi: its kind names the spec file; DRA resources have one by default. */ -}}
{{- $kind := "" -}}
{{- if $r.cdi -}}
{{- $kind = $r.cdi.kind | toString -}}
{{- $kindParts := splitList "/" $kind -}}
{{- $vendor := index $kindParts 0 -}}
{{- $class := ternary (join "/" (rest $kindParts)) "" (gt (len $kindParts) 1) -}}
{{- if or (not (regexMatch $dns $vendor)) (not (regexMatch "^[A-Za-z]" $vendor)) (gt (len $vendor) 253) (not (regexMatch "^[A-Za-z]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$" $class)) -}}
{{- fail (printf "%s.cdi.kind: '%s': must be vendor/class, e.g. example.com/gopher (a DNS name, then 2 to 63 of A-Z a-z 0-9 _ . -; each beginning with a letter)" $at $kind) -}}
{{- end -}}
{{- if or (eq (len $vendor) 1) (eq (len $class) 1) -}}
{{- fail (printf "%s.cdi.kind: '%s': a one-character vendor or class crashes containerd 2.x at every start (its CDI library v1.1.0 panics on such a spec file): use 2 characters or more" $at $kind) -}}
{{- end -}}
{{- if gt (len (printf ".%s.json.lock" $kind)) 255 }}{{ fail (printf "%s.cdi.kind: '%s' is too long to name a file after: at most 244 characters" $at $kind) }}{{ end -}}
{{- if and (hasKey $r.cdi "spec_dir") (not (hasPrefix "/" $r.cdi.spec_dir)) }}{{ fail (printf "%s.cdi.spec_dir: '%s' must be an absolute path" $at $r.cdi.spec_dir) }}{{ end -}}
{{- else if eq $api "dra" -}}
{{- $kind = printf "%s/%s" $v.dra.driver (last $parts) -}}
{{- end -}}
{{- if $kind -}}
{{- range $unsafe | concat (list "LD_") -}}
{{- if hasPrefix (printf "%s_" $env) . -}}
{{- fail (printf "%s.env: '%s': with cdi, each device sets %s_<ID>, which could name a variable the shell or the dynamic loader give meaning to: choose another name" $at $env $env) -}}
{{- end -}}
{{- end -}}
{{- if and $dra $v.dra.deviceMetadata (eq $api "dra") (eq $kind (printf "%s/metadata" $v.dra.driver)) -}}
{{- fail (printf "%s.%s: '%s' is the CDI kind of the device metadata gopherplug mounts into claims' containers (dra.device_metadata): give the resource another cdi.kind" $at (ternary "cdi.kind" "name" (hasKey $r "cdi")) $kind) -}}
{{- end -}}
{{- end -}}
{{- /* attributes and capacity: names and values as the API server takes them (_parse_declared). */ -}}
{{- range $section := list "attributes" "capacity" -}}
{{- range $key, $value := (get $r $section | default dict) -}}
{{- $problem := include "gopherplug.declaredProblem" (dict "at" $at "section" $section "key" $key "value" $value "driver" (ternary $v.dra.driver "" $dra)) -}}
{{- if $problem }}{{ fail $problem }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $problem = include "gopherplug.countProblem" (dict "at" $at "resource" $r) -}}
{{- if $problem }}{{ fail $problem }}{{ end -}}
{{- /* A command's relative path is taken from its configuration file's directory: in the pod, the ConfigMap's. */ -}}
{{- range $key := list "pre_start" "describe" -}}
{{- $program := toString (first (get $r $key | default (list ""))) -}}
{{- if and (contains "/" $program) (not (isAbs $program)) -}}
{{- fail (printf "%s.%s[0]: '%s' is relative, and this configuration has no file here to resolve it against: make it absolute" $at $key $program) -}}
{{- end -}}
{{- end -}}
{{- /* What the device-plugin API alone has, refused with api: dra (nothing given silently unused). */ -}}
{{- if eq $api "dra" -}}
{{- $instead := dict "preferred" "the scheduler chooses devices, by the claim's selectors" "annotations" "devices reach containers only as CDI devices" "pre_start" "NodePrepareResources runs before a pod's containers; gopherplug runs no command there" "pre_start_timeout" "there is no pre_start" -}}
{{- range $key := list "preferred" "annotations" "pre_start" "pre_start_timeout" -}}
{{- if hasKey $r $key }}{{ fail (printf "%s.%s: is for the device-plugin API, and this resource has api: dra (%s)" $at $key (get $instead $key)) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- /* Against the resources before it: names, CDI spec files, DRA pool names. */ -}}
{{- range $k, $other := $v.config.resources -}}
{{- if lt $k $i -}}
{{- if eq (toString $other.name) $name }}{{ fail (printf "%s.name: %s is already used by resources[%d]" $at $name $k) }}{{ end -}}
{{- if and $r.cdi $other.cdi -}}
{{- if and (eq (replace "/" "-" (toString $r.cdi.kind)) (replace "/" "-" (toString $other.cdi.kind))) (eq (clean ($r.cdi.spec_dir | default "/var/run/cdi")) (clean ($other.cdi.spec_dir | default "/var/run/cdi"))) -}}
{{- fail (printf "%s.cdi.kind: '%s' would share the CDI spec file %s/%s.json with resources[%d]: give each resource its own kind" $at $r.cdi.kind (clean ($r.cdi.spec_dir | default "/var/run/cdi")) (replace "/" "-" (toString $r.cdi.kind)) $k) -}}
{{- end -}}
{{- end -}}
{{- /* One env for two resources: a container given devices of both would see one list (unless they share devices). */ -}}
{{- $otherShort := regexReplaceAll "[^A-Z0-9_]" (upper (last (splitList "/" (toString $other.name)))) "_" -}}
{{- $otherEnv := $other.env | default (printf "%s%s_DEVICES" (ternary "_" "" (regexMatch "^[0-9]" $otherShort)) $otherShort) | toString -}}
{{- if and (eq $otherEnv $env) (not (has $name ($other.shared_with | default list))) (not (has (toString $other.name) ($r.shared_with | default list))) -}}
{{- fail (printf "%s.env: %s is also the env of %s (resources[%d]): a container given devices of both would see one list; set another env on %s, or shared_with if both offer the same devices" $at $env $other.name $k $name) -}}
{{- end -}}
{{- if and (eq $api "dra") (eq ($other.api | default "device-plugin") "dra") (eq (include "gopherplug.poolSuffix" $name) (include "gopherplug.poolSuffix" (toString $other.name))) -}}
{{- fail (printf "%s.name: %s would share a DRA pool name with %s of resources[%d]" $at $name $other.name $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* shared_with: names of this file's other resources. */ -}}
{{- range $j, $sharer := $r.shared_with -}}
{{- $names := list -}}
{{- range $v.config.resources }}{{ $names = append $names (toString .name) }}{{ end -}}
{{- if or (eq $sharer $name) (not (has $sharer $names)) -}}
{{- fail (printf "%s.shared_with[%d]: '%s' %s: list the resources that may offer the same device nodes as this one" $at $j $sharer (ternary "is this resource itself" "names no resource of this file" (eq $sharer $name))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $dra (not $hasDra) -}}
{{- fail "mode: dra: no resource has api: dra, so the driver would offer nothing: give the resources it serves api: dra (and those it does not a release in mode device-plugin)" -}}
{{- end -}}
{{- end -}}

{{- /* gopherplug.resourceNameProblem: what the kubelet would refuse as an extended resource name
(resource_name_problem), or "". */ -}}
{{- define "gopherplug.resourceNameProblem" -}}
{{- $parts := splitList "/" . -}}
{{- if ne (len $parts) 2 -}}
must be an extended resource name, domain/name (e.g. example.com/gopher)
{{- else if contains "kubernetes.io/" . -}}
the kubernetes.io domain is reserved for Kubernetes' own resources
{{- else if hasPrefix "requests." . -}}
must not start with "requests."
{{- else if or (not (regexMatch "^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" (index $parts 1))) (gt (len (index $parts 1)) 63) -}}
the name after '/' must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit
{{- else if or (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" (index $parts 0))) (gt (len (index $parts 0)) 244) -}}
the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)
{{- end -}}
{{- end -}}

{{- /*
gopherplug.declaredProblem: why parse_config (_parse_declared, _parse_declared_value) refuses one
attribute or capacity, as "<its path>: <check-config's sentence>", or "" when it takes it. Given a dict:
at (the resource's path), section ("attributes" or "capacity"), key, value, and driver (the DRA
driver, "" in mode device-plugin, where parse_config has none). A named template that returns the
problem, rather than one that fails, so that a test can ask it about many values in one render.

The rules are the API server's (validateQualifiedName and validateDeviceAttribute in kubernetes
pkg/apis/resource/validation/validation.go, ParseQuantity in apimachinery pkg/api/resource/quantity.go):
lengths in bytes (Go's len, as here), digits ASCII (Go's regexps, as here), a domain's letters
either case and ASCII only (Go lower-cases it first, and makes the Kelvin sign a "k": parse_config,
and this, refuse it), and the few canonical_quantity refuses for its own reasons. And the value
judged is the one the node reads: Helm holds every number of the values as a float64, and the
ConfigMap holds it as toYaml writes it, which the plugin reads as YAML 1.1 (gopherplug.yamlKind):
9223372036854775807 arrives as 9223372036854776000, past int64; 1.0 as 1, a whole number; 1e20 as
1e+20, which YAML 1.1 reads as a string; the string "1.5e+999" as a float, inf.
*/ -}}
{{- define "gopherplug.declaredProblem" -}}
{{- $section := .section -}}
{{- $value := .value -}}
{{- $where := printf "%s.%s.%s" .at .section .key -}}
{{- $nameParts := splitList "/" .key -}}
{{- $identifier := last $nameParts -}}
{{- $domain := ternary (first $nameParts) "" (eq (len $nameParts) 2) -}}
{{- $own := list "resource" "id" "healthy" "numaNode" "usbVendor" "usbProduct" "usbSerial" "usbBus" "usbPort" -}}
{{- $types := list "string" "int" "bool" "version" -}}
{{- $kind := include "gopherplug.yamlKind" $value -}}
{{- if or (gt (len $nameParts) 2) (and (eq (len $nameParts) 2) (or (not $domain) (gt (len $domain) 63) (not (regexMatch "^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*$" $domain)))) (not (regexMatch "^[A-Za-z_][A-Za-z0-9_]*$" $identifier)) (gt (len $identifier) 32) -}}
{{- printf "%s: not a valid name for the API server: a C identifier of at most 32 characters (letters, digits, '_'), after an optional domain of at most 63 bytes and '/', e.g. example.com/model" $where -}}
{{- else if and (eq $section "attributes") (has $identifier $own) (or (not $domain) (eq $domain .driver)) -}}
{{- printf "%s: is an attribute gopherplug gives every device itself (%s): choose another name, or one in a domain of your own (example.com/%s)" $where (join ", " (sortAlpha $own)) $identifier -}}
{{- else if and (eq $section "capacity") (eq .key "shares") -}}
{{- printf "%s: is the capacity gopherplug gives a shared device (replicas): choose another name" $where -}}
{{- else if not (toYaml (dict .key $value) | trim) -}}
{{- printf "%s: has a character toYaml cannot write into the ConfigMap (DEL, a C1 control character, U+FFFE): remove it" $where -}}
{{- else if or (eq $kind "tag") (and (eq $kind "map") (or (has "=" (values $value)) (has "<<" (values $value)))) -}}
{{- printf "%s: '=' and '<<' are tags to YAML 1.1, which the plugin reads its configuration with, not strings: the ConfigMap would not load" $where -}}
{{- else if and (eq $kind "map") (hasKey $value "file") -}}
{{- /* {file: <template>, type: ...}: read from a file per device. */ -}}
{{- $unknown := without (keys $value | sortAlpha) "file" "type" -}}
{{- $file := $value.file -}}
{{- $bare := toString $file | replace "{{" "" | replace "}}" "" -}}
{{- $fields := list "id" "path" "name" "target" "sysfs" -}}
{{- $placeholders := regexFindAll "\\{[^{}]*\\}" $bare -1 -}}
{{- $bad := "" -}}
{{- range $placeholders }}{{ if and (not $bad) (not (has (trimPrefix "{" . | trimSuffix "}") $fields)) }}{{ $bad = . }}{{ end }}{{ end -}}
{{- if regexMatch "[{}]" (regexReplaceAll "\\{[^{}]*\\}" $bare "") }}{{ $bad = "a single '{' or '}'" }}{{ end -}}
{{- $allowed := ternary (list "quantity") $types (eq $section "capacity") -}}
{{- if $unknown -}}
{{- printf "%s.%s: unknown key; expected one of file, type" $where (first $unknown) -}}
{{- else if or (not (kindIs "string" $file)) (not $file) -}}
{{- printf "%s.file: must be a non-empty string" $where -}}
{{- else if $bad -}}
{{- printf "%s.file: '%s': bad placeholder (%s); use {%s}" $where $file $bad (join "}, {" $fields) -}}
{{- else if not (or (hasPrefix "/" $bare) (regexMatch "^\\{(path|target|sysfs)\\}" $bare)) -}}
{{- printf "%s.file: '%s' must be an absolute path" $where $file -}}
{{- else if and (hasKey $value "type") (not (has $value.type $allowed)) -}}
{{- printf "%s.type: '%v': must be one of %s" $where $value.type (join ", " $allowed) -}}
{{- end -}}
{{- else if eq $section "capacity" -}}
{{- /* A quantity as ParseQuantity reads one, and as parse_config's canonical_quantity keeps it: a
signed decimal number (a digit at least: Go takes "+", "." and "Ki" as 0, and a mistake), then a binary
suffix (Ki..Ei), a decimal one (n u m k M G T P E) or an exponent of at most 32 bits (the server's
scale is an int32). Refused besides, as canonical_quantity refuses it: above 1E, more than 18 digits
(the server would work it out in big numbers, for as long as its exponent is). */ -}}
{{- $text := ternary $value (toYaml $value | trim) (kindIs "string" $value) -}}
{{- $quantity := "^[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE]([+-]?[0-9]+))?$" -}}
{{- $problem := not (and (has $kind (list "str" "int" "float")) (regexMatch $quantity $text) (not (and (kindIs "string" $value) (eq $kind "float")))) -}}
{{- if not $problem -}}
{{- $number := regexReplaceAll $quantity $text "${1}" -}}
{{- $suffix := regexReplaceAll $quantity $text "${2}" -}}
{{- $exponent := regexReplaceAll $quantity $text "${3}" -}}
{{- $bits := regexReplaceAll "^[+-]?0*" $exponent "" -}}
{{- $problem = or (gt (len $bits) 10) (and (eq (len $bits) 10) (gt $bits "2147483647")) -}}
{{- if and (not $problem) (not (hasSuffix "i" $suffix)) -}}
{{- /* The value is <digits> x 10^places, places a multiple of 3, digits without trailing zeros but those that make it so. */ -}}
{{- $whole := regexReplaceAll "[.].*" $number "" -}}
{{- $fraction := ternary (regexReplaceAll "^[^.]*[.]" $number "") "" (contains "." $number) -}}
{{- $digits := regexReplaceAll "^0+" (print $whole $fraction) "" -}}
{{- $significant := regexReplaceAll "0+$" $digits "" -}}
{{- $scale := ternary (atoi $exponent) (get (dict "n" -9 "u" -6 "m" -3 "" 0 "k" 3 "M" 6 "G" 9 "T" 12 "P" 15 "E" 18) $suffix) (ne $exponent "") -}}
{{- $places := add $scale (sub (len $digits) (len $significant)) (mul -1 (len $fraction)) -}}
{{- $extra := mod (add (mod $places 3) 3) 3 -}}
{{- $problem = and $significant (or (gt (sub $places $extra) 2147483647) (and (gt (sub $places $extra) 18) (gt (add (len $significant) $extra) 18))) -}}
{{- end -}}
{{- end -}}
{{- if $problem -}}
{{- printf "%s: %s is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), or {file: <path>} to read one" $where (ternary (printf "'%s'" $text) $text (kindIs "string" $value)) -}}
{{- end -}}
{{- else -}}
{{- /* An attribute: a string, a whole number, true or false, or {string|int|bool|version: value}. */ -}}
{{- $type := get (dict "str" "string" "int" "int" "bool" "bool") $kind -}}
{{- $literal := $value -}}
{{- if and (eq $kind "map") (eq (len $value) 1) (has (first (keys $value)) $types) -}}
{{- $type = first (keys $value) -}}
{{- $literal = get $value $type -}}
{{- end -}}
{{- $read := include "gopherplug.yamlKind" $literal -}}
{{- $text := ternary $literal (toYaml $literal | trim) (kindIs "string" $literal) -}}
{{- $digits := trimPrefix "-" $text -}}
{{- $semver := "^(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)(-(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(\\.(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*)?(\\+[0-9a-zA-Z-]+(\\.[0-9a-zA-Z-]+)*)?$" -}}
{{- $problem := "" -}}
{{- if not $type -}}
{{- printf "%s: %s: must be a string, a whole number, true or false, {version: \"1.2.3\"}, or {file: <path>, type: string|int|bool|version}" $where (ternary $text (toJson $value) (has $read (list "str" "int" "float" "bool" "null"))) -}}
{{- else if eq $type "bool" -}}
{{- if ne $read "bool" }}{{ $problem = printf "%s is not true or false" $text }}{{ end -}}
{{- else if eq $type "int" -}}
{{- if ne $read "int" -}}
{{- $problem = printf "%s is not a whole number" $text -}}
{{- else if or (gt (len $digits) 19) (and (eq (len $digits) 19) (gt $digits (ternary "9223372036854775808" "9223372036854775807" (hasPrefix "-" $text)))) -}}
{{- $problem = printf "%s does not fit in 64 bits" $text -}}
{{- end -}}
{{- else if ne $read "str" -}}
{{- $problem = printf "%s is not a string" $text -}}
{{- else if gt (len $text) 64 -}}
{{- $problem = printf "it has %d bytes, more than the API server's 64" (len $text) -}}
{{- else if and (eq $type "version") (not (regexMatch $semver $text)) -}}
{{- $problem = printf "'%s' is not a semantic version (semver.org 2.0.0: MAJOR.MINOR.PATCH, e.g. 1.2.3)" $text -}}
{{- end -}}
{{- if $problem }}{{ printf "%s: not a valid %s attribute for the API server: %s" $where $type $problem }}{{ end -}}
{{- end -}}
{{- end -}}

{{- /*
gopherplug.countProblem: the resource's attributes and capacities, with those gopherplug gives each
device itself, past the 32 the API server takes a device (_parse_declarations): the problem, or "".
Given a dict: at (the resource's path), resource.
*/ -}}
{{- define "gopherplug.countProblem" -}}
{{- $r := .resource -}}
{{- $attributes := len ($r.attributes | default dict) -}}
{{- $capacity := len ($r.capacity | default dict) -}}
{{- $own := add 3 (ternary 1 0 (gt (int ($r.replicas | default 1)) 1)) -}}
{{- $total := add $attributes $capacity $own -}}
{{- if gt $total 32 -}}
{{- printf "%s.%s: %d attributes and %d capacities, with the %d gopherplug gives each device, are %d: the API server takes at most 32 a device" .at (ternary "capacity" "attributes" (gt $capacity 0)) $attributes $capacity $own $total -}}
{{- end -}}
{{- end -}}

{{- /*
gopherplug.roomWarning: check-config's warning (_room_warning) for a DRA resource whose devices may
pass the 32 once sysfs gives them its own attributes (numaNode twice, pciBusID, pcieRoot; a USB
device's five more): the plugin leaves the last by name out, with a line. Given what countProblem is.
*/ -}}
{{- define "gopherplug.roomWarning" -}}
{{- $r := .resource -}}
{{- $declared := add (len ($r.attributes | default dict)) (len ($r.capacity | default dict)) 3 (ternary 1 0 (gt (int ($r.replicas | default 1)) 1)) -}}
{{- $most := add $declared 4 (ternary 5 0 (not (empty $r.usb))) -}}
{{- if and (eq ($r.api | default "device-plugin") "dra") (gt $most 32) (le $declared 32) -}}
{{- printf "%s.attributes: with the capacities and gopherplug's own, %d, and up to %d sysfs gives a %s a device may have %d: past 32, the last by name are left out" .at $declared (sub $most $declared) (ternary "USB device (NUMA node, PCI address, USB IDs)" "PCI device (NUMA node, PCI address)" (not (empty $r.usb))) $most -}}
{{- end -}}
{{- end -}}

{{- /*
gopherplug.yamlKind: what the plugin reads a value as, once the chart's toYaml has written it into
the ConfigMap: str, int, float, bool, null, map, list, or tag. YAML 1.1 (PyYAML) reads a number
with a dot as a float and one with an exponent but no dot (1e+20, as toYaml writes 1e20) as a
string; a string past float64 (1.5e+999, 1_0.5e+999), which toYaml leaves unquoted, as a float
(inf); and "=" and "<<", unquoted too, as tags it cannot load.
*/ -}}
{{- define "gopherplug.yamlKind" -}}
{{- $float := "^([-+]?[0-9][0-9_]*[.][0-9_]*|[.][0-9][0-9_]*)[eE][+][0-9]+$" -}}
{{- if has . (list "=" "<<") }}tag
{{- else if and (kindIs "string" .) (regexMatch $float .) (regexMatch "[1-9]" (regexReplaceAll "[eE].*" . "")) (eq (float64 (replace "_" "" .)) 0.0) }}float
{{- else if kindIs "string" . }}str
{{- else if kindIs "bool" . }}bool
{{- else if kindIs "map" . }}map
{{- else if kindIs "slice" . }}list
{{- else if kindIs "invalid" . }}null
{{- else -}}
{{- $text := toYaml . | trim -}}
{{- if regexMatch "^-?[0-9]+$" $text }}int{{ else if contains "." $text }}float{{ else }}str{{ end -}}
{{- end -}}
{{- end -}}

{{- /*
gopherplug.textProblem: the first string in .value (a map, a list or a string, walked in key order)
that toYaml writes unquoted and the plugin's YAML 1.1 reads as something else (gopherplug.yamlKind:
"=" and "<<" as tags, "1.5e+999" as inf), as "<its path>: <sentence>", or "". Given a dict: at (the
path of .value), value. Helm has no quoting of its own to offer here: toYaml writes the resource,
and these values cannot be written as YAML 1.1 reads them back.
*/ -}}
{{- define "gopherplug.textProblem" -}}
{{- $at := .at -}}
{{- $problem := "" -}}
{{- if kindIs "map" .value -}}
{{- range $key := keys .value | sortAlpha -}}
{{- if not $problem }}{{ $problem = include "gopherplug.textProblem" (dict "at" (printf "%s.%s" $at $key) "value" (get $.value $key)) }}{{ end -}}
{{- end -}}
{{- else if kindIs "slice" .value -}}
{{- range $i, $item := .value -}}
{{- if not $problem }}{{ $problem = include "gopherplug.textProblem" (dict "at" (printf "%s[%d]" $at $i) "value" $item) }}{{ end -}}
{{- end -}}
{{- else if kindIs "string" .value -}}
{{- $kind := include "gopherplug.yamlKind" .value -}}
{{- if eq $kind "tag" -}}
{{- $problem = printf "%s: '%s' is a tag to YAML 1.1, which the plugin reads its configuration with, not a string: the ConfigMap would not load; change the value (as a glob, '[=]' and '[<]<' match the same)" $at .value -}}
{{- else if eq $kind "float" -}}
{{- $problem = printf "%s: '%s' is a number past float64 to YAML 1.1, which the plugin reads its configuration with (inf), not a string: the ConfigMap would not load; change the value" $at .value -}}
{{- end -}}
{{- end -}}
{{- $problem -}}
{{- end -}}

{{- /* dra_pool_suffix: a resource name as DNS subdomains ("example.com/my_dev" -> "example.com/my-dev"). */ -}}
{{- define "gopherplug.poolSuffix" -}}
{{- $parts := list -}}
{{- range splitList "/" . -}}
{{- $labels := list -}}
{{- range splitList "." (regexReplaceAll "[^a-z0-9.-]" (lower .) "-") }}{{ if trimAll "-" . }}{{ $labels = append $labels (trimAll "-" .) }}{{ end }}{{ end -}}
{{- $parts = append $parts (join "." $labels) -}}
{{- end -}}
{{- join "/" $parts -}}
{{- end -}}

{{- /*
check-config's warnings, one line each: a pattern that looks like a regular expression (a glob
matches "nvidia\d+" only as those characters: the resource would find no device, and say so only
in the plugin's log).
*/ -}}
{{- define "gopherplug.warnings" -}}
{{- range $i, $r := .Values.config.resources -}}
{{- with include "gopherplug.roomWarning" (dict "at" (printf "config.resources[%d]" $i) "resource" $r) }}
{{ . }}
{{- end -}}
{{- $patterns := list (dict "at" "pattern" "pattern" $r.pattern) -}}
{{- range $j, $m := $r.match }}{{ $patterns = append $patterns (dict "at" (printf "match[%d].pattern" $j) "pattern" $m.pattern) }}{{ end -}}
{{- range $patterns -}}
{{- if and (kindIs "string" .pattern) (regexMatch "\\\\[dwsDWS.]|[+{}()|^$]|\\.\\*" .pattern) -}}
{{- $glob := .pattern | trimPrefix "^" | trimSuffix "$" | replace "\\d+" "[0-9]*" | replace "[0-9]+" "[0-9]*" | replace "\\d*" "*" | replace "\\d" "[0-9]" | replace "\\w+" "*" | replace ".*" "*" | replace ".+" "?*" | replace "\\." "." -}}
{{- $write := ternary "write it as a glob (alternatives: a match entry each)" (printf "write '%s'" $glob) (regexMatch "\\\\[dwsDWS.]|[+{}()|^$]|\\.\\*" $glob) }}
config.resources[{{ $i }}].{{ .at }}: '{{ .pattern }}' looks like a regular expression, but pattern is a glob (fnmatch): {{ $write }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
