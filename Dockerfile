# gopherplug's images: Debian's Python 3.11, the locked dependencies and gopherplug.py, nothing else.
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
# Everything comes from Debian packages and the wheels the project's locks name (requirements/*.lock,
# exact versions with their hashes, written by .ci/lock from pyproject.toml's ranges), on debian:bookworm-slim,
# an image made from Debian's packages by Debian's own tool (debuerreotype): CI makes the same base
# from the same packages and builds this file with buildah, and the runtime tier runs what it built.
# The build stages install Debian's python3.11 and pip, then the project, compiled to bytecode (the
# DaemonSet's root filesystem is read-only, and without .pyc files Python would compile every
# module at each start: slower, and about 3 MB more memory for gopherplug.py alone). Each image is
# then one layer on an empty base: the interpreter, the shared libraries it and its extension
# modules load, the standard library without what a service never imports, and the installed
# project. No shell, no package manager, no pip: about a third of the Debian base alone.

# Debian's interpreter and standard library (with their bytecode, which the packages compile when
# installed), and pip, used only to build. Not pinned to a version: bookworm's archive keeps only
# the latest of each package (a security update replaces it), so a pin would break every build
# after the next update; one release's updates are fixes only.
FROM debian:bookworm-slim AS python
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11-minimal libpython3.11-stdlib python3-pip \
 && rm -rf /var/lib/apt/lists/*

# gopherplug.py alone: gopherplug_standins.py, the stand-ins for tests that pyproject.toml's
# py-modules also names, is left out on purpose (setuptools says it is not found and builds without it).
FROM python AS source
WORKDIR /src
COPY pyproject.toml README.md LICENSE gopherplug.py ./
COPY requirements/device-plugin.lock requirements/dra.lock requirements/

# The image's root filesystem, assembled in /rootfs. The dependencies come from the lock alone:
# --require-hashes refuses any file whose hash the lock does not list, and --no-deps resolves
# nothing (the lock is complete; it also lifts purerpc's h2<4, requirements/overrides.txt says
# why). Then the project itself, with no dependencies. pip installs into
# /usr/local/lib/python3.11/dist-packages (Debian's scheme for the system's Python;
# --break-system-packages is Debian's consent to install beside its own packages, here in a stage
# that is thrown away), with a `gopherplug` script in /usr/local/bin (run by python3.11, whose path
# pip writes into it: Debian's `pip` would write python3, a link the image does not have). Then the image's files: the
# interpreter; the standard library less its tests, IDLE, tkinter, turtle's demos, lib2to3, pydoc's
# topics, ensurepip and distutils (never imported by a service); the installed project; every shared
# library the interpreter and the extension modules (the standard library's and the wheels') link,
# as ldd finds them, with the dynamic loader; and /tmp. tar copies them, keeping each file's mtime,
# which its .pyc records (a .pyc whose source's mtime differs is compiled again, in memory, at every
# start: the root filesystem is read-only).
FROM source AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3.11 -m pip install --no-cache-dir --root-user-action=ignore --break-system-packages \
      --require-hashes --no-deps -r requirements/device-plugin.lock \
 && python3.11 -m pip install --no-cache-dir --root-user-action=ignore --break-system-packages --no-deps /src \
 && mkdir -p /rootfs/tmp && chmod 1777 /rootfs/tmp \
 && tar -C / -cf - --exclude=usr/lib/python3.11/{test,idlelib,tkinter,turtledemo,lib2to3,pydoc_data,ensurepip,distutils} \
      usr/bin/python3.11 usr/lib/python3.11 usr/local/lib/python3.11 usr/local/bin/gopherplug | tar -C /rootfs -xf - \
 && { ldd /usr/bin/python3.11; find /rootfs/usr -name '*.so' -exec ldd {} \; ; } \
  | awk '$2 == "=>" && $3 ~ /^\// {print substr($3, 2)} $1 ~ /^\// {print substr($1, 2)}' | sort -u \
  | tar -C / -chf - -T - | tar -C /rootfs -xf -

FROM build AS build-dra
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3.11 -m pip install --no-cache-dir --root-user-action=ignore --break-system-packages \
      --require-hashes --no-deps -r requirements/dra.lock \
 && tar -C / -cf - usr/local/lib/python3.11 | tar -C /rootfs -xf - \
 && find /rootfs/usr/local/lib/python3.11 -name '*.so' -exec ldd {} \; \
  | awk '$2 == "=>" && $3 ~ /^\// {print substr($3, 2)} $1 ~ /^\// {print substr($1, 2)}' | sort -u \
  | tar -C / -chf - -T - | tar -C /rootfs -xf -

# The kubelet's directories (device-plugins; plugins and plugins_registry for DRA) belong to root
# on every distribution, and the plugin must create its sockets there: both images run as root,
# confined by their DaemonSet's securityContext.
FROM scratch AS dra
COPY --from=build-dra /rootfs /
ENV PATH=/usr/local/bin:/usr/bin
ENTRYPOINT ["gopherplug"]
CMD ["serve"]

FROM scratch AS device-plugin
COPY --from=build /rootfs /
ENV PATH=/usr/local/bin:/usr/bin
ENTRYPOINT ["gopherplug"]
CMD ["serve"]
