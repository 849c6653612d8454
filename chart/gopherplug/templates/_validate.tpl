{{- /*
What `gopherplug serve` would refuse at start, refused at `helm template`/`install` instead: a
DaemonSet takes a values file to every node at once, and a configuration the plugin refuses there
crash-loops the whole pool. Each check is one of parse_config's (gopherplug.py), with its sentence,
at the key's path in the values ("config.resources[0].env: ..."); the test
test_every_refusal_of_parse_config_is_refused_at_render keeps the two lists together (a refusal
that needs the node, a device or PATH, is named there with the reason). values.schema.json keeps
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
{{- /* resource_name_problem: what the kubelet would refuse as an extended resource name. */ -}}
{{- $problem := "" -}}
{{- $parts := splitList "/" $name -}}
{{- if ne (len $parts) 2 -}}
{{- $problem = "must be an extended resource name, domain/name (e.g. example.com/gopher)" -}}
{{- else if contains "kubernetes.io/" $name -}}
{{- $problem = "the kubernetes.io domain is reserved for Kubernetes' own resources" -}}
{{- else if hasPrefix "requests." $name -}}
{{- $problem = "must not start with \"requests.\"" -}}
{{- else if or (not (regexMatch $qualified (index $parts 1))) (gt (len (index $parts 1)) 63) -}}
{{- $problem = "the name after '/' must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit" -}}
{{- else if or (not (regexMatch $dns (index $parts 0))) (gt (len (index $parts 0)) 244) -}}
{{- $problem = "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)" -}}
{{- end -}}
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
{{- $own := list "resource" "id" "healthy" "numaNode" "usbVendor" "usbProduct" "usbSerial" "usbBus" "usbPort" -}}
{{- $fileFields := list "id" "path" "name" "target" "sysfs" -}}
{{- $quantity := "^[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$" -}}
{{- range $section := list "attributes" "capacity" -}}
{{- range $key, $value := (get $r $section | default dict) -}}
{{- $where := printf "%s.%s.%s" $at $section $key -}}
{{- $nameParts := splitList "/" $key -}}
{{- $identifier := last $nameParts -}}
{{- $domain := ternary (first $nameParts) "" (eq (len $nameParts) 2) -}}
{{- if or (gt (len $nameParts) 2) (and (eq (len $nameParts) 2) (or (not $domain) (gt (len $domain) 63) (not (regexMatch $dns (lower $domain))))) (not (regexMatch "^[A-Za-z_][A-Za-z0-9_]*$" $identifier)) (gt (len $identifier) 32) -}}
{{- fail (printf "%s: not a valid name for the API server: a C identifier of at most 32 characters (letters, digits, '_'), after an optional domain of at most 63 and '/', e.g. example.com/model" $where) -}}
{{- end -}}
{{- if and (eq $section "attributes") (has $identifier $own) (or (not $domain) (eq $domain $v.dra.driver)) -}}
{{- fail (printf "%s: is an attribute gopherplug gives every device itself (%s): choose another name, or one in a domain of your own (example.com/%s)" $where (join ", " (sortAlpha $own)) $identifier) -}}
{{- end -}}
{{- if and (eq $section "capacity") (eq $key "shares") }}{{ fail (printf "%s: is the capacity gopherplug gives a shared device (replicas): choose another name" $where) }}{{ end -}}
{{- $number := or (kindIs "float64" $value) (kindIs "int64" $value) (kindIs "int" $value) -}}
{{- if and (kindIs "map" $value) (hasKey $value "file") -}}
{{- $file := toString $value.file -}}
{{- range regexFindAll "\\{[^{}]*\\}" $file -1 -}}
{{- if not (has (trimPrefix "{" . | trimSuffix "}") $fileFields) }}{{ fail (printf "%s.file: '%s': bad placeholder (%s); use {%s}" $where $file . (join "}, {" $fileFields)) }}{{ end -}}
{{- end -}}
{{- if not (or (hasPrefix "/" $file) (hasPrefix "{path}" $file) (hasPrefix "{target}" $file) (hasPrefix "{sysfs}" $file)) }}{{ fail (printf "%s.file: '%s' must be an absolute path" $where $file) }}{{ end -}}
{{- $types := ternary (list "quantity") (list "string" "int" "bool" "version") (eq $section "capacity") -}}
{{- if and (hasKey $value "type") (not (has $value.type $types)) }}{{ fail (printf "%s.type: '%v': must be one of %s" $where $value.type (join ", " $types)) }}{{ end -}}
{{- else if eq $section "capacity" -}}
{{- if not (and (or $number (kindIs "string" $value)) (regexMatch $quantity (toString $value))) -}}
{{- fail (printf "%s: %s is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), or {file: <path>} to read one" $where (ternary (printf "'%v'" $value) (toString $value) (kindIs "string" $value))) -}}
{{- end -}}
{{- else -}}
{{- $typed := and (kindIs "map" $value) (eq (len $value) 1) (has (first (keys $value)) (list "string" "int" "bool" "version")) -}}
{{- if not (or $number (kindIs "string" $value) (kindIs "bool" $value) $typed) -}}
{{- fail (printf "%s: %v: must be a string, a whole number, true or false, {version: \"1.2.3\"}, or {file: <path>, type: string|int|bool|version}" $where $value) -}}
{{- end -}}
{{- $text := toString $value -}}
{{- if $typed }}{{ $text = toString (first (values $value)) }}{{ end -}}
{{- if and (or (kindIs "string" $value) $typed) (gt (len $text) 64) -}}
{{- fail (printf "%s: not a valid string attribute for the API server: it has %d bytes, more than the API server's 64" $where (len $text)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $total := add (len ($r.attributes | default dict)) (len ($r.capacity | default dict)) 3 (ternary 1 0 (gt (int ($r.replicas | default 1)) 1)) -}}
{{- if gt $total 32 -}}
{{- fail (printf "%s.%s: %d attributes and %d capacities, with the %d gopherplug gives each device, are %d: the API server takes at most 32 a device" $at (ternary "capacity" "attributes" (not (empty $r.capacity))) (len ($r.attributes | default dict)) (len ($r.capacity | default dict)) (ternary 4 3 (gt (int ($r.replicas | default 1)) 1)) $total) -}}
{{- end -}}
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
