#!/bin/sh
# Temporal's databases for docker-compose.temporal.yml, run by its temporal-schema service
# (temporalio/admin-tools, the same version as the server) before the server starts: the two
# databases, the schema-version tables, then every schema change up to this version.
#
# Each step is a no-op when already done (the database exists, the version is already past
# 0.0, no change is pending), so the service runs on every `up`, and that is how a new image
# tag for admin-tools and the server gets its schema changes. Temporal upgrades one minor
# version at a time (1.30 to 1.31, not 1.29 to 1.31).
#
# temporal-sql-tool reads SQL_PLUGIN, SQL_HOST, SQL_PORT, SQL_USER and SQL_PASSWORD.
set -eu

for db in temporal temporal_visibility; do
  if [ "$db" = temporal ]; then schema=temporal; else schema=visibility; fi
  echo "temporal-schema: $db"
  temporal-sql-tool --db "$db" create-database
  temporal-sql-tool --db "$db" setup-schema -v 0.0
  temporal-sql-tool --db "$db" update-schema -d "/etc/temporal/schema/postgresql/v12/$schema/versioned"
done
echo "temporal-schema: done"
