# gopherplug's images: a Python runtime, the pinned dependencies and gopherplug.py, nothing else.
#
#   docker build -t gopherplug:0.1.0 .                    # the device plugin (daemonset.yaml)
#   docker build --target dra -t gopherplug:0.1.0-dra .   # the DRA driver (daemonset-dra.yaml)
#   docker run --rm gopherplug:0.1.0 --version
#
# Both install the metrics extra (prometheus_client, pure Python, no dependencies): the shipped
# DaemonSets turn metrics on (metrics_address).
#
# Two images because the DRA driver needs the dra extra (lightkube, its HTTP client and msgspec),
# which a device plugin never imports: the default one stays small. Its stage is the last, so a
# plain build gives it; BuildKit (docker's default builder) builds only the stages a target needs,
# so that build never installs the extra.
#
# The build stages build wheels (all pure Python except protobuf, PyYAML and the extra's msgspec,
# which ship binary wheels) and install them into /install, compiled to bytecode: the DaemonSet's
# root filesystem is read-only, and without .pyc files Python would compile every module at each
# start (slower, and about 3 MB more memory for gopherplug.py alone). Each final stage copies that
# tree onto a clean runtime image, so no pip cache, no build tools and no source tree reach it.

# gopherplug.py alone: gopherplug_standins.py, the stand-ins for tests that pyproject.toml's
# py-modules also names, is left out on purpose (setuptools says it is not found and builds without it).
FROM python:3.11.14-slim-bookworm AS source
WORKDIR /src
COPY pyproject.toml README.md LICENSE gopherplug.py ./

# "/src[metrics]" is ".[metrics]", the project with its extras pinned in pyproject.toml, written so
# that hadolint's DL3013 sees a path: it takes ".[metrics]" for an unpinned package from the index,
# and lets only a bare "." or a name with a "/" through.
FROM source AS build
RUN pip install --no-cache-dir --root-user-action=ignore --prefix=/install "/src[metrics]"

FROM source AS build-dra
RUN pip install --no-cache-dir --root-user-action=ignore --prefix=/install "/src[dra,metrics]"

# The kubelet's directories (device-plugins; plugins and plugins_registry for DRA) belong to root
# on every distribution, and the plugin must create its sockets there: both images run as root,
# confined by their DaemonSet's securityContext.
FROM python:3.11.14-slim-bookworm AS dra
COPY --from=build-dra /install /usr/local
ENTRYPOINT ["gopherplug"]
CMD ["serve"]

FROM python:3.11.14-slim-bookworm AS device-plugin
COPY --from=build /install /usr/local
ENTRYPOINT ["gopherplug"]
CMD ["serve"]
