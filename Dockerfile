# syntax=docker/dockerfile:1
# CPU image of tokenwire (router + shard). The Envoy/GPU targets are added with the gateway work.
FROM python:3.11-slim AS cpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gen ./gen
COPY service ./service
COPY shard ./shard
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir ".[http]"
RUN useradd --create-home tokenwire
USER tokenwire
EXPOSE 50051
ENTRYPOINT ["tokenwire"]
CMD ["launch", "--port", "50051"]
