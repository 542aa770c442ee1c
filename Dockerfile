# syntax=docker/dockerfile:1
# pdserve's container image (issue 14 item 3). Build from the repository root:
#
#   docker build -t registry.example.com/pdserve:0.1.0 .
#
# The image holds pdserve and its runtime dependencies only; model repositories
# come from outside (a volume, KServe's storageUri, an init container, or
# `--model-repository s3://...`): see deploy/kubernetes/README.md.
#
# Stage 1 builds pdserve's wheel and installs it with its dependencies into a
# virtual environment; every dependency must come as a binary wheel
# (--only-binary), so no compiler is needed here and none reaches stage 2.
FROM python:3.11-slim-trixie AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
    && python -m venv /opt/pdserve \
    && /opt/pdserve/bin/pip install --only-binary=:all: /wheels/*.whl

# Stage 2: the slim base, the virtual environment, a non-root user. Nothing else.
# The environment's console scripts are on PATH: `pdserve` and `tritonserver`
# (pdserve with tritonserver's command line and defaults).
FROM python:3.11-slim-trixie AS runtime
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --create-home --home-dir /home/pdserve \
       --shell /usr/sbin/nologin pdserve
COPY --from=build /opt/pdserve /opt/pdserve
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /home/pdserve
# HTTP (KServe V2), gRPC, Prometheus metrics: pdserve's defaults.
EXPOSE 8000 8001 8002
# pdserve is PID 1 (exec form, no shell in between): SIGTERM reaches it and starts
# its drain (readiness false, in-flight requests finish within
# --exit-timeout-secs); it stops and reaps its own python-backend workers.
STOPSIGNAL SIGTERM
# Arguments starting with `tritonserver` run that program (`pdserve tritonserver`), so
# KServe's stock Triton runtime (args: [tritonserver, --model-store=/mnt/models, ...])
# runs this image unchanged: see deploy/kubernetes/kserve/tritonserver.
ENTRYPOINT ["pdserve"]
CMD ["serve", "--model-repository=/models", "--host=0.0.0.0"]
