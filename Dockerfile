# memwatch's sidecar: stores engines' rings in SQLite, exports metrics, answers probes.
# No torch and no GPU needed: the engine image carries the plugin (deploy/engine.Dockerfile).
#   docker build -t memwatch:0.1.0 .
# BASE: any Debian-like image with Python 3.11+ (pyproject.toml's requires-python); where it has no pip (Debian's
# own python3, PEP 668), memwatch goes into a virtual environment at /opt/venv, which is first on PATH either way.
# The dependencies are pinned by deploy/constraints.txt (the versions the tests ran with; deploy/pin_constraints.py
# writes it), so a rebuild installs what was tested.
ARG BASE=python:3.11-slim
FROM ${BASE} AS build
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN command -v pip >/dev/null 2>&1 || python3 -m venv /opt/venv
COPY pyproject.toml README.md MANIFEST.in build_autoload.py ./
COPY engine ./engine
COPY memwatch ./memwatch
COPY deploy/constraints.txt ./constraints.txt
RUN pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt '.[bundles]'

FROM ${BASE}
ENV PATH=/opt/venv/bin:$PATH
COPY --from=build /wheels /wheels
RUN { command -v pip >/dev/null 2>&1 || python3 -m venv /opt/venv; } \
    && pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && groupadd --system --gid 10001 memwatch \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin memwatch \
    && mkdir -p /run/memwatch /var/lib/memwatch && chown 10001:10001 /run/memwatch /var/lib/memwatch
# MEMWATCH=0: the sidecar's own Python never instruments itself.
ENV MEMWATCH=0 MEMWATCH_SPAWN=0 MEMWATCH_RUNTIME_DIR=/run/memwatch/rings \
    MEMWATCH_DB=/var/lib/memwatch/memwatch.db PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 9400 8081
ENTRYPOINT ["memwatch"]
CMD ["serve", "--prometheus", "0.0.0.0:9400", "--health", "0.0.0.0:8081"]
