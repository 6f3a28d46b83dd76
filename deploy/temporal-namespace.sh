#!/bin/sh
# The Temporal namespace Reach uses, for docker-compose.temporal.yml, run by its
# temporal-namespace service (temporalio/admin-tools) once the server is up. Created once,
# left alone after. Retention: how long a finished request stays readable and its RequestID
# deduplicated, as `reach up`'s dev server keeps them (temporal.dev_server.retention_hours).
#
# The temporal CLI reads TEMPORAL_ADDRESS; NAMESPACE and RETENTION come from the service.
set -eu

# The port answers (the healthcheck) a little before the frontend serves: try for a minute.
tries=30
until temporal operator cluster health >/dev/null 2>&1; do
  tries=$((tries - 1))
  if [ "$tries" -le 0 ]; then
    echo "temporal-namespace: no healthy Temporal at $TEMPORAL_ADDRESS" >&2
    exit 1
  fi
  sleep 2
done

if temporal operator namespace describe --namespace "$NAMESPACE" >/dev/null 2>&1; then
  echo "temporal-namespace: $NAMESPACE exists"
else
  temporal operator namespace create --namespace "$NAMESPACE" --retention "$RETENTION"
  echo "temporal-namespace: $NAMESPACE created (retention $RETENTION)"
fi
