#!/usr/bin/env bash
# Local test services for the outbox/inbox framework, without Docker:
#   PostgreSQL (Debian packages)  127.0.0.1:5433  user postgres / password postgres, database app
#   Redis      (Debian packages)  127.0.0.1:6380
#   Apache Kafka, KRaft single node (broker+controller), jars from Maven Central: 127.0.0.1:9092
#
# Usage: scripts/services.sh COMMAND
#   up            install once (cached), start what is not running, wait until each answers,
#                 print the export lines on stdout (progress goes to stderr) and write <state>/env.
#                 Services whose URL is already set in the environment (DATABASE_URL,
#                 KAFKA_BOOTSTRAP_SERVERS, REDIS_URL) are not started: their value is echoed.
#   env           print the export lines (eval "$(scripts/services.sh env)")
#   status        print running/stopped per service; exit 0 only if all are up
#   down [--purge] stop all three (data kept); --purge also deletes the state directory
#   purge         same as down --purge
#   stop-redis | start-redis | stop-kafka | start-kafka | stop-postgres | start-postgres
#                 outage simulation; data is kept (Kafka log dirs, PG cluster); with
#                 OUTBOX_KAFKA_NODES=3 stop-kafka / start-kafka act on the whole cluster
#   stop-broker N | start-broker N | kill-broker N | pause-broker N | resume-broker N | broker-pid N
#                 one broker (N = 1..3) of the 3-node cluster: SIGTERM (controlled shutdown),
#                 start and wait until unfenced, SIGKILL, SIGSTOP, SIGCONT, print its pid
#
# Environment:
#   OUTBOX_SERVICES_DIR  state dir (data, logs, pid files); default ~/.cache/outbox-services/state
#   XDG_CACHE_HOME       the Kafka jars go to ${XDG_CACHE_HOME:-~/.cache}/outbox-services/kafka-<version>
#   OUTBOX_KAFKA_VERSION Kafka version to fetch (default 4.1.1; 4.x only)
#   OUTBOX_SERVICES_TIMEOUT  seconds to wait for a service to answer (default 90)
#   OUTBOX_PG_PORT, OUTBOX_REDIS_PORT, OUTBOX_KAFKA_PORT, OUTBOX_KAFKA_CONTROLLER_PORT
#                        ports (defaults 5433, 6380, 9092, 9093); with OUTBOX_SERVICES_DIR they
#                        let two independent sets of services run side by side
#   OUTBOX_KAFKA_NODES   1 (default: the single broker above, what `make test` uses) or 3: a
#                        cluster of 3 brokers + 3 KRaft controllers, replication factor 3,
#                        min.insync.replicas=2 (see "Kafka cluster" below for the layout).
#                        `up`/`env` then also export KAFKA_PROXIED_BOOTSTRAP_SERVERS (the
#                        brokers' listener advertised at fault-proxy ports) and
#                        OUTBOX_KAFKA_PROXY_LINKS (name=listen:target for that proxy)
#   OUTBOX_KAFKA_CLUSTER_PORT  first of the 12 ports the cluster uses (default 9400)
#   OUTBOX_SECURITY=1    also start the secured endpoints (docs/security.md, "Local secured
#                        services"): certificates made once with openssl into <state>/security
#                        (a CA, a broker/server certificate for 127.0.0.1 and localhost, a client
#                        certificate with an encrypted key); on the Kafka broker a SASL_SSL
#                        listener (SCRAM-SHA-512 user 'ledgerbox', OAUTHBEARER with unsecured
#                        JWTs) and an SSL listener that requires a client certificate (mTLS), the
#                        PLAINTEXT one staying; a second Redis with requirepass, an ACL user
#                        'ledgerbox' and a TLS port; PostgreSQL with ssl=on. `env` then also
#                        prints OUTBOX_SEC_* (listeners, ports, the directory holding the CA,
#                        client certificate and the password files; never a password itself).
#   OUTBOX_KAFKA_SASL_SSL_PORT, OUTBOX_KAFKA_MTLS_PORT, OUTBOX_REDIS_AUTH_PORT,
#   OUTBOX_REDIS_TLS_PORT  ports of the secured endpoints (defaults: Kafka port + 2 and + 3,
#                        Redis port + 1 and + 2)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/outbox-services"
STATE="${OUTBOX_SERVICES_DIR:-$HOME/.cache/outbox-services/state}"
TIMEOUT="${OUTBOX_SERVICES_TIMEOUT:-90}"

PG_PORT="${OUTBOX_PG_PORT:-5433}"
REDIS_PORT="${OUTBOX_REDIS_PORT:-6380}"
KAFKA_PORT="${OUTBOX_KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${OUTBOX_KAFKA_CONTROLLER_PORT:-9093}"
HOST=127.0.0.1

KAFKA_VERSION="${OUTBOX_KAFKA_VERSION:-4.1.1}"
KAFKA_NODES="${OUTBOX_KAFKA_NODES:-1}"
KAFKA_HOME="$CACHE_ROOT/kafka-$KAFKA_VERSION"
KAFKA_LIBS="$KAFKA_HOME/libs"
# Fixed cluster id (base64 of 16 bytes), used only when the storage is formatted the first time.
KAFKA_CLUSTER_ID="MkU3OEVBNTcwNTJENDM2Qk"

PG_DIR="$STATE/postgres"
PG_DATA="$PG_DIR/data"
REDIS_DIR="$STATE/redis"
KAFKA_DIR="$STATE/kafka"
KAFKA_PROPS="$KAFKA_DIR/server.properties"
KAFKA_PIDFILE="$KAFKA_DIR/kafka.pid"

OWN_DATABASE_URL="postgresql+psycopg://postgres:postgres@$HOST:$PG_PORT/app"
OWN_KAFKA_BOOTSTRAP_SERVERS="$HOST:$KAFKA_PORT"
OWN_REDIS_URL="redis://$HOST:$REDIS_PORT/0"

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- helpers
APT_UPDATED=0
apt_install() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to apt-get install $*"
    sudo="sudo"
  fi
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt-get update"
    $sudo apt-get update -q >&2 || die "apt-get update failed"
    APT_UPDATED=1
  fi
  log "apt-get install -y $*"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2 \
    || die "apt-get install $* failed"
}

port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# Tail of a log file to stderr (for error reports).
show_log() {
  if [ -f "$1" ]; then
    printf -- '----- last lines of %s -----\n' "$1" >&2
    tail -n "${2:-40}" "$1" >&2 || true
    printf -- '-----\n' >&2
  fi
}

is_root() { [ "$(id -u)" -eq 0 ]; }

# ---------------------------------------------------------------- PostgreSQL
PG_BIN=""
find_pg_bin() {
  local d
  PG_BIN=""
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ]; then PG_BIN="$d"; fi
  done
  [ -n "$PG_BIN" ]
}

ensure_pg_installed() {
  find_pg_bin && return 0
  apt_install postgresql postgresql-client
  find_pg_bin || die "PostgreSQL binaries not found under /usr/lib/postgresql/*/bin after install"
}

# Run a command as the cluster owner: the 'postgres' OS user when we are root, else ourselves.
as_pg() {
  if is_root; then
    (cd / && runuser -u postgres -- "$@")
  else
    "$@"
  fi
}

# The postgres user must be able to reach the data dir (e.g. /root is usually mode 700):
# grant search-only permission (o+x, no read) on the ancestors that block it.
ensure_pg_traversable() {
  is_root || return 0
  local d="$PG_DIR" dirs=()
  while [ "$d" != "/" ] && [ -n "$d" ]; do dirs=("$d" "${dirs[@]}"); d="$(dirname "$d")"; done
  for d in "${dirs[@]}"; do
    if ! runuser -u postgres -- test -x "$d" 2>/dev/null; then
      log "granting search permission (chmod o+x) on $d so the postgres user can reach its data dir"
      chmod o+x "$d"
    fi
  done
}

pg_running() {
  [ -f "$PG_DATA/postmaster.pid" ] || return 1
  local pid
  pid="$(head -n1 "$PG_DATA/postmaster.pid" 2>/dev/null || true)"
  pid_alive "$pid" || return 1
  "$PG_BIN/pg_isready" -q -h "$HOST" -p "$PG_PORT" -t 2 >/dev/null 2>&1
}

pg_write_conf() {
  cat >"$PG_DATA/outbox-services.conf" <<EOF
# written by scripts/services.sh on every start; do not edit
port = $PG_PORT
listen_addresses = '$HOST'
unix_socket_directories = '$PG_DIR/run'
max_connections = 300
# PREPARED transactions hold a transaction id until COMMIT PREPARED: the relay's tests check
# that one does not stall other keys (tests/faults/test_relay_cursor.py).
max_prepared_transactions = 10
shared_buffers = 256MB
fsync = on
logging_collector = off
log_min_messages = warning
EOF
  is_root && chown postgres: "$PG_DATA/outbox-services.conf"
  return 0
}

pg_init() {
  log "initializing PostgreSQL cluster in $PG_DATA"
  rm -rf "$PG_DATA"
  mkdir -p "$PG_DATA" "$PG_DIR/run"
  chmod 700 "$PG_DATA"
  local pwfile="$PG_DIR/.pwfile"
  printf 'postgres\n' >"$pwfile"
  is_root && chown -R postgres: "$PG_DIR"
  as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U postgres --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >"$PG_DIR/initdb.log" 2>&1 \
    || { show_log "$PG_DIR/initdb.log"; die "initdb failed"; }
  rm -f "$pwfile"
  echo "include_if_exists = 'outbox-services.conf'" >>"$PG_DATA/postgresql.conf"
}

start_postgres() {
  ensure_pg_installed
  if pg_running; then log "PostgreSQL already running on $HOST:$PG_PORT"; return 0; fi
  if port_open "$PG_PORT"; then
    die "port $PG_PORT is in use by something other than our PostgreSQL ($PG_DATA); stop it or free the port"
  fi
  mkdir -p "$PG_DIR"
  ensure_pg_traversable
  if [ ! -f "$PG_DATA/PG_VERSION" ]; then pg_init; fi
  mkdir -p "$PG_DIR/run"
  is_root && chown postgres: "$PG_DIR" "$PG_DIR/run"
  pg_write_conf
  log "starting PostgreSQL ($("$PG_BIN/postgres" --version)) on $HOST:$PG_PORT"
  # pg_ctl removes a stale postmaster.pid by itself.
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_DIR/postgres.log" -w -t "$TIMEOUT" start >/dev/null 2>"$PG_DIR/pg_ctl.err" 3>&- 9>&- \
    || { cat "$PG_DIR/pg_ctl.err" >&2; show_log "$PG_DIR/postgres.log"; die "PostgreSQL did not start"; }
  local deadline=$((SECONDS + TIMEOUT))
  until "$PG_BIN/pg_isready" -q -h "$HOST" -p "$PG_PORT" -t 2 >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || { show_log "$PG_DIR/postgres.log"; die "PostgreSQL not ready after ${TIMEOUT}s"; }
    sleep 0.3
  done
  pg_ensure_db
}

pg_ensure_db() {
  local psql="$PG_BIN/psql"
  [ -x "$psql" ] || psql="$(command -v psql || true)"
  [ -n "$psql" ] || die "psql not found (install postgresql-client)"
  local exists
  exists="$(PGPASSWORD=postgres "$psql" -h "$HOST" -p "$PG_PORT" -U postgres -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = 'app'")" || die "cannot connect to PostgreSQL as postgres"
  if [ "$exists" != "1" ]; then
    log "creating database app"
    PGPASSWORD=postgres "$psql" -h "$HOST" -p "$PG_PORT" -U postgres -d postgres -qc "CREATE DATABASE app" >&2
  fi
}

stop_postgres() {
  find_pg_bin || { log "PostgreSQL not installed"; return 0; }
  if [ -f "$PG_DATA/postmaster.pid" ] && pid_alive "$(head -n1 "$PG_DATA/postmaster.pid")"; then
    log "stopping PostgreSQL"
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 60 stop >/dev/null 2>&1 \
      || log "pg_ctl stop reported an error (already stopped?)"
  else
    log "PostgreSQL not running"
  fi
}

# ---------------------------------------------------------------- Redis
ensure_redis_installed() {
  command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 && return 0
  apt_install redis-server redis-tools
  command -v redis-server >/dev/null 2>&1 || die "redis-server not found after install"
}

redis_running() {
  command -v redis-cli >/dev/null 2>&1 || return 1
  [ "$(timeout 5 redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
}

start_redis() {
  ensure_redis_installed
  if redis_running; then log "Redis already running on $HOST:$REDIS_PORT"; return 0; fi
  if port_open "$REDIS_PORT"; then
    die "port $REDIS_PORT is in use by something that does not answer Redis PING"
  fi
  mkdir -p "$REDIS_DIR"
  rm -f "$REDIS_DIR/redis.pid"  # stale: nothing answers on the port
  log "starting Redis ($(redis-server --version | awk '{print $3}' | sed 's/^v=//')) on $HOST:$REDIS_PORT"
  (cd "$REDIS_DIR" && redis-server --port "$REDIS_PORT" --bind "$HOST" --daemonize yes \
    --pidfile "$REDIS_DIR/redis.pid" --dir "$REDIS_DIR" --logfile "$REDIS_DIR/redis.log" \
    --save '' --appendonly no >&2 3>&- 9>&-) || { show_log "$REDIS_DIR/redis.log"; die "redis-server failed to start"; }
  local deadline=$((SECONDS + TIMEOUT))
  until redis_running; do
    [ "$SECONDS" -lt "$deadline" ] || { show_log "$REDIS_DIR/redis.log"; die "Redis not answering PING after ${TIMEOUT}s"; }
    sleep 0.1
  done
}

stop_redis() {
  local pid=""
  [ -f "$REDIS_DIR/redis.pid" ] && pid="$(cat "$REDIS_DIR/redis.pid" 2>/dev/null || true)"
  if redis_running; then
    log "stopping Redis"
    timeout 10 redis-cli -h "$HOST" -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  else
    log "Redis not running"
  fi
  local deadline=$((SECONDS + 20))
  while port_open "$REDIS_PORT" || pid_alive "$pid"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      pid_alive "$pid" && kill -9 "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
  rm -f "$REDIS_DIR/redis.pid"
}

# ---------------------------------------------------------------- Kafka
JAVA=""
find_java() {
  JAVA=""
  if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then JAVA="$JAVA_HOME/bin/java";
  elif command -v java >/dev/null 2>&1; then JAVA="$(command -v java)"; fi
  [ -n "$JAVA" ] || return 1
  local major
  major="$("$JAVA" -version 2>&1 | awk -F'"' '/version/ {print $2; exit}' | cut -d. -f1)"
  [ "${major:-0}" -ge 17 ] 2>/dev/null
}

ensure_java() {
  find_java && return 0
  apt_install openjdk-17-jre-headless
  find_java || die "Java 17+ not found after installing openjdk-17-jre-headless"
}

ensure_kafka_libs() {
  if [ -f "$KAFKA_HOME/.complete" ] && ls "$KAFKA_LIBS"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null 2>&1; then
    return 0
  fi
  command -v mvn >/dev/null 2>&1 || apt_install maven
  log "fetching Apache Kafka $KAFKA_VERSION jars from Maven Central into $KAFKA_LIBS"
  rm -rf "$KAFKA_HOME"
  mkdir -p "$KAFKA_HOME"
  # Run Maven on a copy of the pom outside the repository so nothing (target/ ...) lands in the tree.
  cp "$SCRIPT_DIR/kafka/pom.xml" "$KAFKA_HOME/pom.xml"
  (cd "$KAFKA_HOME" && mvn -B -q -Dstyle.color=never -f pom.xml -Dkafka.version="$KAFKA_VERSION" \
      dependency:copy-dependencies -DoutputDirectory="$KAFKA_LIBS" >"$KAFKA_HOME/mvn.log" 2>&1) \
    || { show_log "$KAFKA_HOME/mvn.log" 60; die "mvn could not fetch the Kafka $KAFKA_VERSION jars"; }
  ls "$KAFKA_LIBS"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null 2>&1 || die "kafka_2.13-$KAFKA_VERSION.jar missing after mvn"
  touch "$KAFKA_HOME/.complete"
}

kafka_write_config() {
  mkdir -p "$KAFKA_DIR/data" "$KAFKA_DIR/logs"
  cat >"$KAFKA_PROPS" <<EOF
# written by scripts/services.sh on every start; do not edit
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KAFKA_DIR/data
num.partitions=3
default.replication.factor=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=3
num.io.threads=4
log.retention.hours=168
log.segment.bytes=1073741824
EOF
  cat >"$KAFKA_DIR/log4j2.properties" <<EOF
status = warn
name = kafka-broker
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = $KAFKA_DIR/logs/server.log
appender.file.filePattern = $KAFKA_DIR/logs/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.cleaner.name = kafka.log.LogCleaner
logger.cleaner.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
EOF
  cat >"$KAFKA_DIR/log4j2-tools.properties" <<EOF
status = error
name = kafka-tools
appender.err.type = Console
appender.err.name = STDERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %p %m (%c)%n
rootLogger.level = ERROR
rootLogger.appenderRef.err.ref = STDERR
EOF
  cat >"$KAFKA_DIR/admin.properties" <<EOF
request.timeout.ms=5000
default.api.timeout.ms=10000
EOF
}

kafka_tool() {  # kafka_tool MAIN_CLASS ARGS...
  (cd "$KAFKA_DIR" && "$JAVA" -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2-tools.properties" -cp "$KAFKA_LIBS/*" "$@")
}

# pid of OUR broker: from the pid file if it really is our kafka.Kafka, else found in /proc.
kafka_pid() {
  local pid p
  if [ -f "$KAFKA_PIDFILE" ]; then
    pid="$(cat "$KAFKA_PIDFILE" 2>/dev/null || true)"
    if pid_alive "$pid" && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "kafka.Kafka $KAFKA_PROPS"; then
      echo "$pid"; return 0
    fi
  fi
  for p in /proc/[0-9]*; do
    if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "kafka.Kafka $KAFKA_PROPS"; then
      pid="${p#/proc/}"
      echo "$pid" >"$KAFKA_PIDFILE" 2>/dev/null || true
      echo "$pid"; return 0
    fi
  done
  return 1
}

kafka_running() {
  kafka_pid >/dev/null && port_open "$KAFKA_PORT"
}

kafka_probe() {  # a real metadata round trip
  timeout 30 bash -c "$(declare -f kafka_tool); JAVA='$JAVA' KAFKA_DIR='$KAFKA_DIR' KAFKA_LIBS='$KAFKA_LIBS'; \
    kafka_tool org.apache.kafka.tools.TopicCommand --bootstrap-server '$HOST:$KAFKA_PORT' \
      --command-config '$KAFKA_DIR/admin.properties' --list" >/dev/null 2>"$KAFKA_DIR/logs/probe.err"
}

kafka_version_banner() {
  log "Apache Kafka $KAFKA_VERSION (KRaft, combined broker+controller) on $HOST:$KAFKA_PORT"
}

start_kafka() {
  ensure_java
  ensure_kafka_libs
  mkdir -p "$KAFKA_DIR/logs" "$KAFKA_DIR/data"
  local pid
  if pid="$(kafka_pid)"; then
    if port_open "$KAFKA_PORT"; then
      log "Kafka already running (pid $pid)"; kafka_version_banner; return 0
    fi
    log "Kafka process $pid exists but is not listening yet; waiting"
  else
    rm -f "$KAFKA_PIDFILE"
    if port_open "$KAFKA_PORT" || port_open "$KAFKA_CONTROLLER_PORT"; then
      die "port $KAFKA_PORT or $KAFKA_CONTROLLER_PORT is in use by something other than our broker ($KAFKA_PROPS)"
    fi
    kafka_write_config
    kafka_security_config
    if [ ! -f "$KAFKA_DIR/data/meta.properties" ]; then
      log "formatting Kafka storage (cluster id $KAFKA_CLUSTER_ID)"
      kafka_tool kafka.tools.StorageTool format --standalone --ignore-formatted \
        -t "$KAFKA_CLUSTER_ID" -c "$KAFKA_PROPS" >"$KAFKA_DIR/logs/format.log" 2>&1 \
        || { show_log "$KAFKA_DIR/logs/format.log"; die "kafka storage format failed"; }
    fi
    log "starting Kafka $KAFKA_VERSION broker on $HOST:$KAFKA_PORT (controller $HOST:$KAFKA_CONTROLLER_PORT)"
    (cd "$KAFKA_DIR" && exec setsid nohup "$JAVA" -Xmx512m -Xms512m -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
      -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true \
      -XX:ErrorFile="$KAFKA_DIR/logs/hs_err_pid%p.log" \
      -Dkafka.logs.dir="$KAFKA_DIR/logs" -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.properties" \
      -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_PROPS" \
      >>"$KAFKA_DIR/logs/stdout.log" 2>&1 </dev/null 3>&- 9>&-) &
    for _ in $(seq 1 50); do pid="$(kafka_pid)" && break; sleep 0.1; done
    [ -n "${pid:-}" ] || { show_log "$KAFKA_DIR/logs/stdout.log"; show_log "$KAFKA_DIR/logs/server.log"; die "Kafka JVM did not start"; }
  fi
  local deadline=$((SECONDS + TIMEOUT))
  while :; do
    if ! pid_alive "$pid"; then
      show_log "$KAFKA_DIR/logs/stdout.log" 20; show_log "$KAFKA_DIR/logs/server.log" 60
      die "Kafka broker (pid $pid) exited during startup"
    fi
    if port_open "$KAFKA_PORT" && kafka_probe; then break; fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      show_log "$KAFKA_DIR/logs/probe.err" 10; show_log "$KAFKA_DIR/logs/server.log" 60
      die "Kafka broker not answering on $HOST:$KAFKA_PORT after ${TIMEOUT}s (pid $pid still running)"
    fi
    sleep 0.5
  done
  kafka_version_banner
}

stop_kafka() {
  local pid
  if ! pid="$(kafka_pid)"; then
    log "Kafka not running"; rm -f "$KAFKA_PIDFILE"; return 0
  fi
  log "stopping Kafka (pid $pid, SIGTERM)"
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + 60))
  while pid_alive "$pid"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "Kafka did not stop within 60s; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; break
    fi
    sleep 0.2
  done
  rm -f "$KAFKA_PIDFILE"
}

# ---------------------------------------------------------------- Kafka cluster (OUTBOX_KAFKA_NODES=3)
# Three brokers and a quorum of three DEDICATED KRaft controllers (six JVMs), not three combined
# broker+controller nodes: with combined nodes, stopping two brokers also stops two of the three
# voters, the quorum is gone, no ISR can shrink, and a produce with acks=all just times out.
# With the quorum on its own processes, stopping two brokers leaves the survivor leading every
# partition with ISR {itself} < min.insync.replicas=2: produce is refused with the retriable
# NOT_ENOUGH_REPLICAS, which is the fault the soak injects (and what production clusters,
# where the docs advise dedicated controllers, answer). Controllers are cheap when idle
# (160 MB serial-GC heap, ~1% CPU each); brokers get 384 MB each: 6 JVMs ~ 2.3 GB RSS on the
# 2-core 24 GiB box.
#
# Ports, from B = OUTBOX_KAFKA_CLUSTER_PORT (default 9400), broker N = 1..3:
#   B+N-1   PLAINTEXT listener of broker N (inter-broker, tests, the soak's own observer)
#   B+2+N   PROXIED listener of broker N: what a fault proxy forwards to
#   B+5+N   advertised address of the PROXIED listener: where the fault proxy listens, so a
#           client that bootstraps through the proxy gets metadata naming only proxy ports
#   B+8+N   controller N (node id 10+N)
CLUSTER_NODES=3
CLUSTER_BASE="${OUTBOX_KAFKA_CLUSTER_PORT:-9400}"
CLUSTER_DIR="$STATE/kafka-cluster"
# Fixed cluster id of the 3-node cluster (base64 of 16 bytes), used when storage is formatted.
CLUSTER_ID="rLlU8LcCQd-HuQuy_1ePjQ"

broker_port()       { echo $((CLUSTER_BASE + $1 - 1)); }
broker_real_proxied_port() { echo $((CLUSTER_BASE + 2 + $1)); }
broker_proxy_port() { echo $((CLUSTER_BASE + 5 + $1)); }
controller_port()   { echo $((CLUSTER_BASE + 8 + $1)); }
node_dir() { echo "$CLUSTER_DIR/$1-$2"; }  # node_dir broker|controller N

cluster_voters() {
  local n out=""
  for n in $(seq 1 $CLUSTER_NODES); do out="$out${out:+,}$((10 + n))@$HOST:$(controller_port "$n")"; done
  echo "$out"
}
cluster_bootstrap() {
  local n out=""
  for n in $(seq 1 $CLUSTER_NODES); do out="$out${out:+,}$HOST:$(broker_port "$n")"; done
  echo "$out"
}
cluster_proxied_bootstrap() {
  local n out=""
  for n in $(seq 1 $CLUSTER_NODES); do out="$out${out:+,}$HOST:$(broker_proxy_port "$n")"; done
  echo "$out"
}
# listen=target pairs a fault proxy must serve: advertised proxied port -> real proxied port.
cluster_proxy_links() {
  local n out=""
  for n in $(seq 1 $CLUSTER_NODES); do
    out="$out${out:+,}kafka-$n=$(broker_proxy_port "$n"):$(broker_real_proxied_port "$n")"
  done
  echo "$out"
}

check_node_index() {
  case "${1:-}" in 1|2|3) ;; *) die "broker index must be 1, 2 or 3 (got '${1:-}')" ;; esac
}

node_write_log4j() {  # node_write_log4j DIR
  sed -e "s#$KAFKA_DIR/logs#$1/logs#g" "$KAFKA_DIR/log4j2.properties" >"$1/log4j2.properties"
}

cluster_write_config() {
  # The single-broker writer also writes the shared tool configs (log4j2-tools, admin.properties).
  kafka_write_config
  local n d voters
  voters="$(cluster_voters)"
  for n in $(seq 1 $CLUSTER_NODES); do
    d="$(node_dir controller "$n")"
    mkdir -p "$d/data" "$d/logs"
    cat >"$d/server.properties" <<CONF
# written by scripts/services.sh on every start; do not edit
process.roles=controller
node.id=$((10 + n))
controller.quorum.voters=$voters
listeners=CONTROLLER://$HOST:$(controller_port "$n")
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT
log.dirs=$d/data
# With eligible leader replicas (KIP-966, on by default since 4.1) the cluster-wide
# min.insync.replicas is a metadata record written when the CONTROLLERS are formatted, from
# their config: the brokers' own setting alone leaves it at 1.
min.insync.replicas=2
num.io.threads=2
num.network.threads=1
background.threads=2
CONF
    node_write_log4j "$d"
    d="$(node_dir broker "$n")"
    mkdir -p "$d/data" "$d/logs"
    cat >"$d/server.properties" <<CONF
# written by scripts/services.sh on every start; do not edit
process.roles=broker
node.id=$n
controller.quorum.voters=$voters
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://$HOST:$(broker_port "$n"),PROXIED://$HOST:$(broker_real_proxied_port "$n")
advertised.listeners=PLAINTEXT://$HOST:$(broker_port "$n"),PROXIED://$HOST:$(broker_proxy_port "$n")
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,PROXIED:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$d/data
num.partitions=3
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
auto.create.topics.enable=true
offsets.topic.replication.factor=3
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
background.threads=2
log.retention.hours=168
log.segment.bytes=268435456
CONF
    node_write_log4j "$d"
  done
}

node_pid() {  # node_pid ROLE N -> pid of that node's JVM (pid file checked against /proc)
  local d props pid p
  d="$(node_dir "$1" "$2")"; props="$d/server.properties"
  if [ -f "$d/kafka.pid" ]; then
    pid="$(cat "$d/kafka.pid" 2>/dev/null || true)"
    if pid_alive "$pid" && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "kafka.Kafka $props"; then
      echo "$pid"; return 0
    fi
  fi
  for p in /proc/[0-9]*; do
    if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "kafka.Kafka $props"; then
      pid="${p#/proc/}"; echo "$pid" >"$d/kafka.pid" 2>/dev/null || true
      echo "$pid"; return 0
    fi
  done
  return 1
}

node_state() {  # one letter from /proc/PID/stat: R/S running, T stopped (SIGSTOP)
  awk '{print $3}' "/proc/$1/stat" 2>/dev/null || echo "?"
}

node_format() {  # node_format ROLE N
  local d; d="$(node_dir "$1" "$2")"
  [ -f "$d/data/meta.properties" ] && return 0
  log "formatting Kafka storage of $1 $2 (cluster id $CLUSTER_ID)"
  kafka_tool kafka.tools.StorageTool format --ignore-formatted -t "$CLUSTER_ID" \
    -c "$d/server.properties" >"$d/logs/format.log" 2>&1 \
    || { show_log "$d/logs/format.log"; die "kafka storage format of $1 $2 failed"; }
}

node_launch() {  # node_launch ROLE N: start the JVM if not running (does not wait for readiness)
  local role="$1" n="$2" d pid heap
  d="$(node_dir "$role" "$n")"
  if pid="$(node_pid "$role" "$n")"; then
    [ "$(node_state "$pid")" = "T" ] && { log "$role $n (pid $pid) was paused: SIGCONT"; kill -CONT "$pid"; }
    # Launched by a script from before .start-time existed: its launch is the process's start.
    [ -f "$d/logs/.start-time" ] || proc_start_stamp "$pid" "$d/logs/.start-time" || true
    return 0
  fi
  rm -f "$d/kafka.pid"
  node_format "$role" "$n"
  if [ "$role" = controller ]; then
    heap=(-Xmx160m -Xms160m -XX:+UseSerialGC)
  else
    heap=(-Xmx384m -Xms384m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:ParallelGCThreads=2
          -XX:ConcGCThreads=1 -XX:InitiatingHeapOccupancyPercent=35)
  fi
  # When this start began, in the log's own timestamp format (the JVM logs in UTC): readiness
  # is read from the lines stamped at or after it, whichever file log4j has rolled them into.
  TZ=UTC date '+%Y-%m-%d %H:%M:%S,%3N' >"$d/logs/.start-time"
  (cd "$d" && exec setsid nohup "$JAVA" "${heap[@]}" -server -XX:CICompilerCount=2 \
    -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true \
    -XX:ErrorFile="$d/logs/hs_err_pid%p.log" \
    -Duser.timezone=UTC -Dkafka.logs.dir="$d/logs" -Dlog4j2.configurationFile="$d/log4j2.properties" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$d/server.properties" \
    >>"$d/logs/stdout.log" 2>&1 </dev/null 3>&- 8>&- 9>&-) &
  for _ in $(seq 1 50); do node_pid "$role" "$n" >/dev/null && return 0; sleep 0.1; done
  show_log "$d/logs/stdout.log"; die "$role $n JVM did not start"
}

proc_start_stamp() {  # proc_start_stamp PID FILE: when PID started, as a launch stamp in FILE
  # (log4j's format, UTC, whole seconds), FILE's mtime set to it
  local ticks btime epoch
  ticks="$(awk '{print $22}' "/proc/$1/stat" 2>/dev/null)" || return 1
  btime="$(awk '/^btime/ {print $2}' /proc/stat)"
  epoch=$((btime + ticks / $(getconf CLK_TCK)))
  TZ=UTC date -d "@$epoch" '+%Y-%m-%d %H:%M:%S,000' >"$2" && touch -d "@$epoch" "$2"
}

node_logged_since_start() {  # node_logged_since_start ROLE N REGEX: did the node log a line
  # matching REGEX since its last launch? Reads server.log and the files log4j rolled it into
  # (server.log.1..3, written since the launch) and keeps the lines stamped at or after the
  # launch: an offset into server.log is lost when the file rolls over (a busy broker logs
  # 20 MB in minutes), and the line sought may then be in server.log.1.
  local d start f files=()
  d="$(node_dir "$1" "$2")"
  start="$(cat "$d/logs/.start-time" 2>/dev/null)" || return 1
  for f in "$d"/logs/server.log "$d"/logs/server.log.[0-9]*; do
    [ -f "$f" ] && ! [ "$d/logs/.start-time" -nt "$f" ] && files+=("$f")
  done
  [ "${#files[@]}" -gt 0 ] || return 1
  # A stamped line starts with log4j's [%d] exactly ("[yyyy-MM-dd HH:mm:ss,SSS]", 25 chars):
  # another line starting with "[" (a multi-line message) compared as later than any stamp.
  awk -v start="[$start]" -v re="$3" '
    /^\[[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9],[0-9][0-9][0-9]\]/ &&
      substr($0, 1, 25) >= start && $0 ~ re { found = 1; exit }
    END { exit !found }' "${files[@]}"
}

node_wait_ready() {  # node_wait_ready ROLE N: a broker is ready once unfenced; a controller once listening
  local role="$1" n="$2" d pid port deadline=$((SECONDS + TIMEOUT))
  d="$(node_dir "$role" "$n")"
  if [ "$role" = broker ]; then port="$(broker_port "$n")"; else port="$(controller_port "$n")"; fi
  while :; do
    pid="$(node_pid "$role" "$n")" || {
      show_log "$d/logs/stdout.log" 20; show_log "$d/logs/server.log" 60; die "$role $n exited during startup"; }
    if port_open "$port"; then
      if [ "$role" = controller ]; then return 0; fi
      if node_logged_since_start broker "$n" "has been unfenced|Kafka Server started"; then return 0; fi
      # Logged so much since its launch that log4j rolled the line away (server.log.3, the
      # last kept, written since then: 60 MB or more): a broker up that long is ready.
      if [ -f "$d/logs/server.log.3" ] && ! [ "$d/logs/.start-time" -nt "$d/logs/server.log.3" ] \
        && [ -f "$d/logs/.start-time" ]; then return 0; fi
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      show_log "$d/logs/server.log" 60; die "$role $n (pid $pid) not ready after ${TIMEOUT}s"
    fi
    sleep 0.3
  done
}

node_stop() {  # node_stop ROLE N SIGNAL: TERM (controlled shutdown) or KILL (crash)
  local role="$1" n="$2" sig="$3" pid d deadline
  d="$(node_dir "$role" "$n")"
  if ! pid="$(node_pid "$role" "$n")"; then log "$role $n not running"; rm -f "$d/kafka.pid"; return 0; fi
  log "stopping $role $n (pid $pid, SIG$sig)"
  kill -CONT "$pid" 2>/dev/null || true  # a paused JVM cannot handle SIGTERM
  kill "-$sig" "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 60))
  while pid_alive "$pid"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "$role $n did not stop within 60s; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; break
    fi
    sleep 0.1
  done
  rm -f "$d/kafka.pid"
}

lock_node() {  # serialize commands on one broker (not the whole state dir: faults overlap)
  mkdir -p "$(node_dir broker "$1")"
  exec 8>"$(node_dir broker "$1")/.lock"
  flock -w 120 8 || die "could not lock broker $1"
}

start_cluster() {
  ensure_java
  ensure_kafka_libs
  mkdir -p "$CLUSTER_DIR"
  local n running=1
  for n in $(seq 1 $CLUSTER_NODES); do
    node_pid controller "$n" >/dev/null && node_pid broker "$n" >/dev/null || running=0
  done
  if [ "$running" -eq 0 ]; then
    for n in $(seq 1 $CLUSTER_NODES); do
      if ! node_pid controller "$n" >/dev/null && port_open "$(controller_port "$n")"; then
        die "port $(controller_port "$n") is in use by something other than our controller $n"
      fi
      if ! node_pid broker "$n" >/dev/null && port_open "$(broker_port "$n")"; then
        die "port $(broker_port "$n") is in use by something other than our broker $n"
      fi
    done
    cluster_write_config
    log "starting Kafka $KAFKA_VERSION cluster: controllers on $HOST:$(controller_port 1)-$(controller_port 3), brokers on $(cluster_bootstrap)"
  fi
  for n in $(seq 1 $CLUSTER_NODES); do node_launch controller "$n"; done
  for n in $(seq 1 $CLUSTER_NODES); do node_launch broker "$n"; done
  for n in $(seq 1 $CLUSTER_NODES); do node_wait_ready controller "$n"; done
  for n in $(seq 1 $CLUSTER_NODES); do node_wait_ready broker "$n"; done
  log "Apache Kafka $KAFKA_VERSION (KRaft, 3 controllers + 3 brokers, RF 3, min.insync.replicas=2) on $(cluster_bootstrap)"
}

stop_cluster() {  # brokers in parallel (controlled shutdown), then the controllers
  local n
  for n in $(seq 1 $CLUSTER_NODES); do node_stop broker "$n" TERM & done
  wait
  for n in $(seq 1 $CLUSTER_NODES); do node_stop controller "$n" TERM & done
  wait
}

cluster_running() {
  local n
  for n in $(seq 1 $CLUSTER_NODES); do
    node_pid broker "$n" >/dev/null && port_open "$(broker_port "$n")" || return 1
  done
}

cluster_any_running() {
  local n
  [ -d "$CLUSTER_DIR" ] || return 1
  for n in $(seq 1 $CLUSTER_NODES); do
    node_pid broker "$n" >/dev/null && return 0
    node_pid controller "$n" >/dev/null && return 0
  done
  return 1
}

cluster_status() {
  local n pid rc=0 st
  for role in controller broker; do
    for n in $(seq 1 $CLUSTER_NODES); do
      if [ "$role" = broker ]; then port="$(broker_port "$n")"; else port="$(controller_port "$n")"; fi
      if pid="$(node_pid "$role" "$n")"; then
        st="$(node_state "$pid")"
        if [ "$st" = T ]; then echo "kafka $role $n: paused (SIGSTOP, pid $pid, $HOST:$port)"; rc=1
        elif port_open "$port"; then echo "kafka $role $n: running ($HOST:$port, pid $pid)"
        else echo "kafka $role $n: starting (pid $pid, port $port not open)"; rc=1; fi
      else
        echo "kafka $role $n: stopped"; rc=1
      fi
    done
  done
  return $rc
}

cmd_broker() {  # cmd_broker ACTION N
  local action="$1" n="${2:-}" pid
  [ "$KAFKA_NODES" = 3 ] || die "$action-broker needs the 3-node cluster (OUTBOX_KAFKA_NODES=3)"
  check_node_index "$n"
  case "$action" in
    stop)   lock_node "$n"; node_stop broker "$n" TERM ;;
    kill)   pid="$(node_pid broker "$n")" || die "broker $n is not running"
            log "kill -9 broker $n (pid $pid)"; kill -KILL "$pid"
            while pid_alive "$pid"; do sleep 0.05; done
            rm -f "$(node_dir broker "$n")/kafka.pid" ;;
    pause)  pid="$(node_pid broker "$n")" || die "broker $n is not running"
            log "SIGSTOP broker $n (pid $pid)"; kill -STOP "$pid" ;;
    resume) pid="$(node_pid broker "$n")" || die "broker $n is not running"
            log "SIGCONT broker $n (pid $pid)"; kill -CONT "$pid" ;;
    start)  lock_node "$n"; ensure_java; ensure_kafka_libs
            [ -f "$(node_dir broker "$n")/server.properties" ] || die "cluster never started: run up first"
            node_launch broker "$n"; node_wait_ready broker "$n"; log "broker $n ready" ;;
    pid)    node_pid broker "$n" || die "broker $n is not running" ;;
  esac
}

# ---------------------------------------------------------------- security (opt-in: OUTBOX_SECURITY=1)
# Everything secured lives in its own functions and files, next to the plain services: the
# PLAINTEXT Kafka listener, the first Redis and PostgreSQL's password login stay as they are.
SECURITY="${OUTBOX_SECURITY:-0}"
SEC_DIR="$STATE/security"
KAFKA_SASL_SSL_PORT="${OUTBOX_KAFKA_SASL_SSL_PORT:-$((KAFKA_PORT + 2))}"
KAFKA_MTLS_PORT="${OUTBOX_KAFKA_MTLS_PORT:-$((KAFKA_PORT + 3))}"
REDIS_AUTH_PORT="${OUTBOX_REDIS_AUTH_PORT:-$((REDIS_PORT + 1))}"
REDIS_TLS_PORT="${OUTBOX_REDIS_TLS_PORT:-$((REDIS_PORT + 2))}"
REDIS_SEC_DIR="$STATE/redis-secure"
SEC_USER=ledgerbox

security_on() { [ "$SECURITY" = "1" ]; }

# A CA, a server certificate (127.0.0.1, localhost) and a client certificate whose key is
# encrypted; random passwords in files (mode 600). Made once per state directory.
sec_make_certs() {
  [ -f "$SEC_DIR/.complete" ] && return 0
  command -v openssl >/dev/null 2>&1 || apt_install openssl
  log "making a local CA, server and client certificates in $SEC_DIR (openssl)"
  rm -rf "$SEC_DIR"
  mkdir -p "$SEC_DIR"
  chmod 700 "$SEC_DIR"
  ( set -e
    cd "$SEC_DIR"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 3650 \
      -subj "/CN=ledgerbox local test CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=localhost"
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.pem
    cat server.key server.pem >kafka-keystore.pem
    openssl rand -hex 16 | sed 's/^/keypw-/' >client-key-password
    openssl req -newkey rsa:2048 -nodes -keyout client-plain.key -out client.csr \
      -subj "/CN=ledgerbox-client"
    printf 'extendedKeyUsage=clientAuth\n' >client.ext
    openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out client.pem
    openssl pkcs8 -topk8 -v2 aes-256-cbc -in client-plain.key -out client.key \
      -passout file:client-key-password
    openssl rand -hex 16 | sed 's/^/sasl-/' >kafka-sasl-password
    openssl rand -hex 16 | sed 's/^/redis-/' >redis-password
    rm -f client-plain.key ./*.csr ./*.ext ./*.srl
    chmod 644 ca.pem server.pem client.pem
  ) >"$STATE/security-certs.log" 2>&1 || { show_log "$STATE/security-certs.log"; die "openssl failed"; }
  touch "$SEC_DIR/.complete"
}

# Kafka: a SASL_SSL listener (SCRAM-SHA-512, and OAUTHBEARER with Kafka's unsecured JWT
# validator, for tests only) and an SSL listener that requires a client certificate.
# Appended to the config kafka_write_config wrote.
kafka_security_config() {
  security_on || return 0
  [ "${OUTBOX_KAFKA_NODES:-1}" = "1" ] || die "OUTBOX_SECURITY=1 works with the single broker only"
  sec_make_certs
  sed -i \
    -e "s|^listeners=.*|&,SASL_SSL://$HOST:$KAFKA_SASL_SSL_PORT,SSL://$HOST:$KAFKA_MTLS_PORT|" \
    -e "s|^advertised.listeners=.*|&,SASL_SSL://$HOST:$KAFKA_SASL_SSL_PORT,SSL://$HOST:$KAFKA_MTLS_PORT|" \
    -e "s|^listener.security.protocol.map=.*|&,SASL_SSL:SASL_SSL,SSL:SSL|" \
    "$KAFKA_PROPS"
  cat >>"$KAFKA_PROPS" <<EOF
# OUTBOX_SECURITY=1 (scripts/services.sh kafka_security_config)
ssl.keystore.type=PEM
ssl.keystore.location=$SEC_DIR/kafka-keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$SEC_DIR/ca.pem
listener.name.ssl.ssl.client.auth=required
listener.name.sasl_ssl.ssl.client.auth=none
listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512,OAUTHBEARER
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required unsecuredLoginStringClaim_sub="broker";
listener.name.sasl_ssl.oauthbearer.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.internals.unsecured.OAuthBearerUnsecuredValidatorCallbackHandler
EOF
}

# The SCRAM user, through the PLAINTEXT listener (AlterUserScramCredentials, KIP-554). The
# tool takes the password on its command line only (its --add-config-file mangles the
# mechanism name): a local, random test password, visible in ps for a second.
kafka_security_user() {
  security_on || return 0
  [ -f "$KAFKA_DIR/data/.scram-$SEC_USER" ] && return 0
  kafka_tool kafka.admin.ConfigCommand --bootstrap-server "$HOST:$KAFKA_PORT" \
    --command-config "$KAFKA_DIR/admin.properties" --alter --entity-type users \
    --entity-name "$SEC_USER" \
    --add-config "SCRAM-SHA-512=[iterations=4096,password=$(cat "$SEC_DIR/kafka-sasl-password")]" \
    >"$KAFKA_DIR/logs/scram.log" 2>&1 \
    || die "could not create the SCRAM user $SEC_USER (see $KAFKA_DIR/logs/scram.log)"
  touch "$KAFKA_DIR/data/.scram-$SEC_USER"
  log "Kafka SCRAM-SHA-512 user $SEC_USER created"
}

# A broker started before OUTBOX_SECURITY=1 has no secured listener: restart it.
kafka_security_ensure() {
  security_on || return 0
  if kafka_running && ! port_open "$KAFKA_SASL_SSL_PORT"; then
    log "Kafka runs without the secured listeners: restarting it with them"
    stop_kafka
    start_kafka
  fi
  kafka_security_user
}

redis_secure_running() {
  [ -f "$SEC_DIR/redis-password" ] || return 1
  [ "$(REDISCLI_AUTH="$(cat "$SEC_DIR/redis-password")" timeout 5 redis-cli -h "$HOST" -p "$REDIS_AUTH_PORT" --user "$SEC_USER" ping 2>/dev/null)" = "PONG" ]
}

# A second Redis: requirepass (the default user), the ACL user 'ledgerbox' with the same
# password, a plain port and a TLS port (server certificate of the local CA).
start_redis_secure() {
  security_on || return 0
  ensure_redis_installed
  sec_make_certs
  if redis_secure_running; then log "secured Redis already running on $HOST:$REDIS_AUTH_PORT (TLS $REDIS_TLS_PORT)"; return 0; fi
  if port_open "$REDIS_AUTH_PORT" || port_open "$REDIS_TLS_PORT"; then
    die "port $REDIS_AUTH_PORT or $REDIS_TLS_PORT is in use by something other than our secured Redis"
  fi
  mkdir -p "$REDIS_SEC_DIR"
  chmod 700 "$REDIS_SEC_DIR"
  local password
  password="$(cat "$SEC_DIR/redis-password")"
  (umask 077; cat >"$REDIS_SEC_DIR/redis.conf" <<EOF
# written by scripts/services.sh (OUTBOX_SECURITY=1); do not edit
bind $HOST
port $REDIS_AUTH_PORT
tls-port $REDIS_TLS_PORT
tls-cert-file $SEC_DIR/server.pem
tls-key-file $SEC_DIR/server.key
tls-ca-cert-file $SEC_DIR/ca.pem
tls-auth-clients no
requirepass $password
user $SEC_USER on >$password ~* &* +@all
daemonize yes
pidfile $REDIS_SEC_DIR/redis.pid
dir $REDIS_SEC_DIR
logfile $REDIS_SEC_DIR/redis.log
save ""
appendonly no
EOF
)
  log "starting secured Redis on $HOST:$REDIS_AUTH_PORT (AUTH) and $HOST:$REDIS_TLS_PORT (TLS)"
  (cd "$REDIS_SEC_DIR" && redis-server "$REDIS_SEC_DIR/redis.conf" >&2 3>&- 9>&-) \
    || { show_log "$REDIS_SEC_DIR/redis.log"; die "secured redis-server failed to start"; }
  local deadline=$((SECONDS + TIMEOUT))
  until redis_secure_running; do
    [ "$SECONDS" -lt "$deadline" ] || { show_log "$REDIS_SEC_DIR/redis.log"; die "secured Redis not answering after ${TIMEOUT}s"; }
    sleep 0.1
  done
}

stop_redis_secure() {
  local pid=""
  [ -f "$REDIS_SEC_DIR/redis.pid" ] && pid="$(cat "$REDIS_SEC_DIR/redis.pid" 2>/dev/null || true)"
  pid_alive "$pid" || return 0
  log "stopping secured Redis"
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + 20))
  while pid_alive "$pid"; do
    [ "$SECONDS" -lt "$deadline" ] || { kill -9 "$pid" 2>/dev/null || true; break; }
    sleep 0.1
  done
  rm -f "$REDIS_SEC_DIR/redis.pid"
}

pg_ssl_state() {
  PGPASSWORD=postgres "$PG_BIN/psql" -h "$HOST" -p "$PG_PORT" -U postgres -d postgres -tAc 'SHOW ssl' 2>/dev/null || true
}

# PostgreSQL with TLS (ssl=on, the local CA's server certificate); password logins over
# TCP as before, so sslmode=verify-full and sslmode=disable both work.
pg_security_config() {
  security_on || return 0
  sec_make_certs
  install -m 600 "$SEC_DIR/server.key" "$PG_DIR/tls-server.key"
  install -m 644 "$SEC_DIR/server.pem" "$PG_DIR/tls-server.pem"
  is_root && chown postgres: "$PG_DIR/tls-server.key" "$PG_DIR/tls-server.pem"
  cat >"$PG_DATA/outbox-security.conf" <<EOF
# written by scripts/services.sh (OUTBOX_SECURITY=1); do not edit
ssl = on
ssl_cert_file = '$PG_DIR/tls-server.pem'
ssl_key_file = '$PG_DIR/tls-server.key'
EOF
  is_root && chown postgres: "$PG_DATA/outbox-security.conf"
  grep -qF "include_if_exists = 'outbox-security.conf'" "$PG_DATA/postgresql.conf" \
    || echo "include_if_exists = 'outbox-security.conf'" >>"$PG_DATA/postgresql.conf"
  if [ "$(pg_ssl_state)" != "on" ]; then
    log "reloading PostgreSQL with ssl=on"
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" reload >/dev/null
    local deadline=$((SECONDS + 30))
    until [ "$(pg_ssl_state)" = "on" ]; do
      [ "$SECONDS" -lt "$deadline" ] || { show_log "$PG_DIR/postgres.log"; die "PostgreSQL did not turn ssl on"; }
      sleep 0.3
    done
  fi
}

security_up() {
  security_on || return 0
  sec_make_certs
  [ -n "${DATABASE_URL:-}" ] || pg_security_config
  start_redis_secure
  [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ] || kafka_security_ensure
}

security_status() {  # one line per secured endpoint (OUTBOX_SECURITY=1 only); rc 1 if one is down
  security_on || return 0
  local rc=0
  if port_open "$KAFKA_SASL_SSL_PORT" && port_open "$KAFKA_MTLS_PORT"; then
    echo "kafka tls: running (SASL_SSL $HOST:$KAFKA_SASL_SSL_PORT, mTLS $HOST:$KAFKA_MTLS_PORT)"
  else echo "kafka tls: stopped"; rc=1; fi
  if redis_secure_running; then echo "redis auth: running ($HOST:$REDIS_AUTH_PORT, TLS $HOST:$REDIS_TLS_PORT)"
  else echo "redis auth: stopped"; rc=1; fi
  return $rc
}

print_security_exports() {  # the secured endpoints that answer (no password: files hold them)
  security_on || return 0
  [ -f "$SEC_DIR/.complete" ] || { log "no certificates in $SEC_DIR (run up with OUTBOX_SECURITY=1)"; return 0; }
  printf 'export OUTBOX_SEC_DIR=%q\n' "$SEC_DIR"
  printf 'export OUTBOX_SEC_USER=%s\n' "$SEC_USER"
  if port_open "$KAFKA_SASL_SSL_PORT" && port_open "$KAFKA_MTLS_PORT"; then
    printf 'export OUTBOX_SEC_KAFKA_SASL_SSL=%s\n' "$HOST:$KAFKA_SASL_SSL_PORT"
    printf 'export OUTBOX_SEC_KAFKA_MTLS=%s\n' "$HOST:$KAFKA_MTLS_PORT"
  else
    log "the secured Kafka listeners do not answer (ports $KAFKA_SASL_SSL_PORT, $KAFKA_MTLS_PORT)"
  fi
  if redis_secure_running; then
    printf 'export OUTBOX_SEC_REDIS_AUTH_PORT=%s\n' "$REDIS_AUTH_PORT"
    printf 'export OUTBOX_SEC_REDIS_TLS_PORT=%s\n' "$REDIS_TLS_PORT"
  else
    log "the secured Redis does not answer (port $REDIS_AUTH_PORT)"
  fi
}

# ---------------------------------------------------------------- commands
print_exports() {  # print_exports -> export lines for env-provided or our running services; rc 1 if any missing
  local rc=0
  if [ -n "${DATABASE_URL:-}" ]; then printf 'export DATABASE_URL=%q\n' "$DATABASE_URL"
  elif find_pg_bin && pg_running; then printf 'export DATABASE_URL=%s\n' "$OWN_DATABASE_URL"
  else log "PostgreSQL is not running"; rc=1; fi
  if [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then printf 'export KAFKA_BOOTSTRAP_SERVERS=%q\n' "$KAFKA_BOOTSTRAP_SERVERS"
  elif [ "$KAFKA_NODES" = 3 ]; then
    if cluster_running; then
      printf 'export KAFKA_BOOTSTRAP_SERVERS=%s\n' "$(cluster_bootstrap)"
      printf 'export KAFKA_PROXIED_BOOTSTRAP_SERVERS=%s\n' "$(cluster_proxied_bootstrap)"
      printf 'export OUTBOX_KAFKA_PROXY_LINKS=%s\n' "$(cluster_proxy_links)"
    else log "Kafka cluster is not running"; rc=1; fi
  elif kafka_running; then printf 'export KAFKA_BOOTSTRAP_SERVERS=%s\n' "$OWN_KAFKA_BOOTSTRAP_SERVERS"
  else log "Kafka is not running"; rc=1; fi
  if [ -n "${REDIS_URL:-}" ]; then printf 'export REDIS_URL=%q\n' "$REDIS_URL"
  elif redis_running; then printf 'export REDIS_URL=%s\n' "$OWN_REDIS_URL"
  else log "Redis is not running"; rc=1; fi
  print_security_exports
  return $rc
}

lock_state() {
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"
  flock -w 300 9 || die "could not lock $STATE/.lock (another services.sh running?)"
}

cmd_up() {
  exec 3>&1 1>&2   # only the export lines go to the real stdout (fd 3)
  local t0=$SECONDS
  if [ -n "${DATABASE_URL:-}" ] && [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ] && [ -n "${REDIS_URL:-}" ]; then
    log "DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS and REDIS_URL already set: starting nothing"
    if security_on; then lock_state; security_up; fi
    print_exports >&3
    return 0
  fi
  lock_state
  [ -n "${REDIS_URL:-}" ] && log "REDIS_URL set: not starting Redis" || start_redis
  [ -n "${DATABASE_URL:-}" ] && log "DATABASE_URL set: not starting PostgreSQL" || start_postgres
  if [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then log "KAFKA_BOOTSTRAP_SERVERS set: not starting Kafka"
  elif [ "$KAFKA_NODES" = 3 ]; then start_cluster
  else start_kafka; fi
  security_up
  local out
  out="$(print_exports)" || die "a service is not running after up"
  printf '%s\n' "$out" >"$STATE/env"
  log "ready in $((SECONDS - t0))s (state: $STATE)"
  printf '%s\n' "$out" >&3
}

cmd_status() {
  local rc=0 pid
  if find_pg_bin && pg_running; then echo "postgres: running ($HOST:$PG_PORT, data $PG_DATA)"
  else echo "postgres: stopped"; rc=1; fi
  if redis_running; then echo "redis:    running ($HOST:$REDIS_PORT)"
  else echo "redis:    stopped"; rc=1; fi
  if [ "$KAFKA_NODES" = 3 ]; then cluster_status || rc=1
  elif pid="$(kafka_pid)" && port_open "$KAFKA_PORT"; then echo "kafka:    running ($HOST:$KAFKA_PORT, pid $pid, Kafka $KAFKA_VERSION KRaft)"
  elif [ -n "${pid:-}" ]; then echo "kafka:    starting (pid $pid, port $KAFKA_PORT not open)"; rc=1
  else echo "kafka:    stopped"; rc=1; fi
  security_status || rc=1
  return $rc
}

cmd_down() {
  local purge=0
  case "${1:-}" in --purge|purge) purge=1 ;; "") ;; *) die "unknown option for down: $1" ;; esac
  [ -d "$STATE" ] && lock_state
  stop_kafka
  if cluster_any_running; then stop_cluster; fi
  stop_redis
  stop_redis_secure
  stop_postgres
  if [ "$purge" -eq 1 ]; then
    case "$STATE" in ""|/|"$HOME"|"$HOME/") die "refusing to delete state dir '$STATE'" ;; esac
    log "deleting $STATE"
    rm -rf "$STATE"
  fi
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

main() {
  case "$KAFKA_NODES" in 1|3) ;; *) die "OUTBOX_KAFKA_NODES must be 1 or 3 (got '$KAFKA_NODES')" ;; esac
  local cmd="${1:-}"
  [ $# -gt 0 ] && shift
  case "$cmd" in
    up)             cmd_up ;;
    env)            print_exports ;;
    status)         cmd_status ;;
    down|stop)      cmd_down "$@" ;;
    purge)          cmd_down --purge ;;
    stop-redis)     stop_redis ;;
    start-redis)    start_redis ;;
    stop-kafka)     if [ "$KAFKA_NODES" = 3 ]; then stop_cluster; else lock_state; stop_kafka; fi ;;
    start-kafka)    exec 1>&2; if [ "$KAFKA_NODES" = 3 ]; then start_cluster; else lock_state; start_kafka; fi ;;
    broker-pid)     cmd_broker pid "$@" ;;
    stop-broker|start-broker|kill-broker|pause-broker|resume-broker)
                    [ "$cmd" = start-broker ] && exec 1>&2
                    cmd_broker "${cmd%-broker}" "$@" ;;
    stop-postgres)  lock_state; stop_postgres ;;
    start-postgres) lock_state; exec 1>&2; start_postgres ;;
    -h|--help|help|"") usage ;;
    *) log "unknown command: $cmd"; usage ;;
  esac
}

# Sourced (tests of the functions above), define only; run as a script, do the command.
[ "${BASH_SOURCE[0]}" != "$0" ] || main "$@"
