# The gateway and worker image used by docker-compose.temporal.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml constraints.txt README.md reach.yaml worker.py ./
COPY reach ./reach
COPY workflows ./workflows
COPY activities ./activities
COPY connectors ./connectors
COPY gateway_api ./gateway_api
COPY agent_reach_sdk ./agent_reach_sdk
COPY agent_reach_proto ./agent_reach_proto
COPY examples ./examples
RUN pip install --no-cache-dir -c constraints.txt .
ENV REACH_CONFIG=/app/reach.yaml
# 7600: the HTTP API; 7601: the gRPC front (reach.v1.Reach, health, reflection)
EXPOSE 7600 7601
CMD ["reach", "gateway"]
