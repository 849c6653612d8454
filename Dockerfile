# gopherplug's image: a Python runtime, the pinned runtime dependencies and gopherplug.py, nothing else.
#
#   docker build -t gopherplug .
#   docker run --rm gopherplug --version
#
# Stage 1 builds wheels (all pure Python except protobuf and PyYAML, which ship binary wheels) and
# installs them into /install, compiled to bytecode: the DaemonSet's root filesystem is read-only,
# and without .pyc files Python would compile every module at each start (slower, and about 3 MB
# more memory for gopherplug.py alone). Stage 2 copies that tree onto a clean runtime image, so no
# pip cache, no build tools and no source tree reach the final image.

FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE gopherplug.py ./
RUN pip install --no-cache-dir --root-user-action=ignore --prefix=/install .

FROM python:3.11.14-slim-bookworm
COPY --from=build /install /usr/local
# The kubelet's device-plugin directory belongs to root on every distribution, and the plugin must
# create its socket there: the container runs as root, confined by the DaemonSet's securityContext.
ENTRYPOINT ["gopherplug"]
CMD ["serve"]
