# kvroute's container: the gateway (`kvroute serve`) or the endpoint picker (`kvroute epp`).
#   docker build -t kvroute:0.1.0 .
# The Helm chart (deploy/helm/kvroute) runs it as user 10001 with a read-only root filesystem.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# the gateway, the ext_proc picker and fleet mode (NATS); not the simulator's numpy/matplotlib
RUN pip install --no-cache-dir --prefix=/install '.[k8s,fleet]'

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN groupadd --gid 10001 kvroute && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvroute
USER 10001:10001
# 8000: OpenAI API, /metrics, /livez, /readyz; 9002: ext_proc; 9003: gRPC health
EXPOSE 8000 9002 9003
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["kvroute"]
CMD ["serve", "--config", "/etc/kvroute/gateway.yaml"]
