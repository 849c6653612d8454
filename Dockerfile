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

# Debian's interpreter and standard library, and pip, used only to build: the packages of
# requirements/debian-python.lock (written by .ci/lock-debian). bookworm's archive keeps only the
# newest version of each package, so the lock is two things. With DEBIAN_SNAPSHOT=<the lock's
# date> (its first line), the build reads snapshot.debian.org's copy of the archive at that date and
# installs exactly the locked versions: any other version, a package the lock does not name or a
# locked one missing fails the build, naming it (the image is then the one the lock describes, byte
# for byte). Without it, the same package names come from today's archive: a security update or a
# point release since the lock gives newer versions, and the build says which on one warning line
# and goes on (an image that cannot be built after Debian's next security update would not be
# deployable); .ci/lock-debian moves the lock to them.
FROM debian:bookworm-slim AS python
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_SNAPSHOT=
COPY requirements/debian-python.lock /tmp/
RUN if [ -n "$DEBIAN_SNAPSHOT" ]; then \
      rm -f /etc/apt/sources.list.d/debian.sources; \
      echo "deb [check-valid-until=no] http://snapshot.debian.org/archive/debian/$DEBIAN_SNAPSHOT bookworm main" >/etc/apt/sources.list; \
    fi \
 && installed() { dpkg-query -W -f '${Package}=${Version}\n' | LC_ALL=C sort; } \
 && installed >/tmp/before && grep -v '^#' /tmp/debian-python.lock | LC_ALL=C sort >/tmp/locked \
 && if [ -n "$DEBIAN_SNAPSHOT" ]; then cp /tmp/locked /tmp/wanted; else cut -d= -f1 /tmp/locked >/tmp/wanted; fi \
 && apt-get update \
 && xargs apt-get install -y --no-install-recommends </tmp/wanted \
 && extra=$(installed | LC_ALL=C comm -23 - /tmp/before | LC_ALL=C comm -23 - /tmp/locked | paste -sd ' ') \
 && missing=$(installed | LC_ALL=C comm -13 - /tmp/locked | paste -sd ' ') \
 && if [ -n "$extra$missing" ]; then \
      differs="requirements/debian-python.lock is not what apt installed (installed, not locked: ${extra:-none}; locked, not installed: ${missing:-none})"; \
      if [ -n "$DEBIAN_SNAPSHOT" ]; then echo "error: $differs: run .ci/lock-debian" >&2; exit 1; fi; \
      echo "warning: $differs (Debian's archive has moved since the lock): the image is not the locked one; DEBIAN_SNAPSHOT builds that, .ci/lock-debian moves the lock" >&2; \
    fi \
 && rm -rf /var/lib/apt/lists/* /tmp/before /tmp/locked /tmp/wanted /tmp/debian-python.lock

# gopherplug.py alone: gopherplug_cel.py (demo --select's CEL) and gopherplug_standins.py (the stand-ins
# for tests), which pyproject.toml's py-modules also names, are left out on purpose (setuptools says
# they are not found and builds without them).
FROM python AS source
WORKDIR /src
COPY pyproject.toml README.md LICENSE gopherplug.py ./
COPY requirements/device-plugin.lock requirements/dra.lock requirements/build.lock requirements/

# The image's root filesystem, assembled in /rootfs. The dependencies come from the lock alone:
# --require-hashes refuses any file whose hash the lock does not list, and --no-deps resolves
# nothing (the lock is complete; it also lifts purerpc's h2<4, requirements/overrides.txt says
# why). Then the project itself, with no dependencies, built by the setuptools of
# requirements/build.lock (pyproject.toml's build-system; bookworm's is too old), installed beside
# the build and not in the image: pip's own build isolation would fetch whatever setuptools is
# newest that day, and what it writes (the metadata) would change with it. pip installs into
# /usr/local/lib/python3.11/dist-packages (Debian's scheme for the system's Python;
# --break-system-packages is Debian's consent to install beside its own packages, here in a stage
# that is thrown away), with a `gopherplug` script in /usr/local/bin (run by python3.11, whose path
# pip writes into it: Debian's `pip` would write python3, a link the image does not have). Then the image's files: the
# interpreter; the standard library less its tests, IDLE, tkinter, turtle's demos, lib2to3, pydoc's
# topics, ensurepip and distutils (never imported by a service); the installed project; every shared
# library the interpreter and the extension modules (the standard library's and the wheels') link,
# as ldd finds them, with the dynamic loader; and /tmp.
#
# Then what makes two builds the same, byte for byte (.ci/images checks it): every file's time is
# SOURCE_DATE_EPOCH (the commit's time, passed by .ci/images and the release; 0 when not given),
# and the bytecode is compiled again here, by one process with a fixed hash seed, in a fixed order:
# the .pyc files Debian's packages and pip compile differ from build to build (set constants
# follow the process's random string hashes, and pip compiles in parallel). Each .pyc records its
# source's time and size, and a .pyc whose source's time differs is compiled again, in memory, at
# every start (the root filesystem is read-only): so the sources get their time first, and every
# builder keeps it (COPY keeps a file's time; buildah's --timestamp and BuildKit's
# rewrite-timestamp set or clamp it to this same time). -s/-p record each module's path as the
# image has it, not under /rootfs (tracebacks name it).
FROM source AS build
ARG SOURCE_DATE_EPOCH=0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3.11 -m pip install --no-cache-dir --root-user-action=ignore --break-system-packages --no-compile \
      --require-hashes --no-deps -r requirements/device-plugin.lock \
 && python3.11 -m pip install --no-cache-dir --root-user-action=ignore --no-compile \
      --require-hashes --no-deps --target /tmp/build-tools -r requirements/build.lock \
 && PYTHONPATH=/tmp/build-tools python3.11 -m pip install --no-cache-dir --root-user-action=ignore \
      --break-system-packages --no-compile --no-deps --no-build-isolation /src \
 && mkdir -p /rootfs/tmp && chmod 1777 /rootfs/tmp \
 && tar -C / -cf - --exclude=usr/lib/python3.11/{test,idlelib,tkinter,turtledemo,lib2to3,pydoc_data,ensurepip,distutils} \
      usr/bin/python3.11 usr/lib/python3.11 usr/local/lib/python3.11 usr/local/bin/gopherplug | tar -C /rootfs -xf - \
 && { ldd /usr/bin/python3.11; find /rootfs/usr -name '*.so' -exec ldd {} \; ; } \
  | awk '$2 == "=>" && $3 ~ /^\// {print substr($3, 2)} $1 ~ /^\// {print substr($1, 2)}' | sort -u \
  | tar -C / -chf - -T - | tar -C /rootfs -xf - \
 && find /rootfs -name __pycache__ -prune -exec rm -rf {} + \
 && find /rootfs -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} + \
 && PYTHONHASHSEED=0 python3.11 -m compileall -q -f -s /rootfs -p / --invalidation-mode timestamp \
      /rootfs/usr/lib/python3.11 /rootfs/usr/local/lib/python3.11 \
 && find /rootfs -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

# The DRA driver's dependencies over the device plugin's files, and the same steps for the same
# reasons (the bytecode of every module compiled again: the same order and the same process).
FROM build AS build-dra
ARG SOURCE_DATE_EPOCH=0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3.11 -m pip install --no-cache-dir --root-user-action=ignore --break-system-packages --no-compile \
      --require-hashes --no-deps -r requirements/dra.lock \
 && tar -C / -cf - usr/local/lib/python3.11 | tar -C /rootfs -xf - \
 && find /rootfs/usr/local/lib/python3.11 -name '*.so' -exec ldd {} \; \
  | awk '$2 == "=>" && $3 ~ /^\// {print substr($3, 2)} $1 ~ /^\// {print substr($1, 2)}' | sort -u \
  | tar -C / -chf - -T - | tar -C /rootfs -xf - \
 && find /rootfs -name __pycache__ -prune -exec rm -rf {} + \
 && find /rootfs -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} + \
 && PYTHONHASHSEED=0 python3.11 -m compileall -q -f -s /rootfs -p / --invalidation-mode timestamp \
      /rootfs/usr/lib/python3.11 /rootfs/usr/local/lib/python3.11 \
 && find /rootfs -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

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
