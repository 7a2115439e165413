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
#                 outage simulation; data is kept (Kafka log dirs, PG cluster)
#
# Environment:
#   OUTBOX_SERVICES_DIR  state dir (data, logs, pid files); default ~/.cache/outbox-services/state
#   XDG_CACHE_HOME       the Kafka jars go to ${XDG_CACHE_HOME:-~/.cache}/outbox-services/kafka-<version>
#   OUTBOX_KAFKA_VERSION Kafka version to fetch (default 4.1.1; 4.x only)
#   OUTBOX_SERVICES_TIMEOUT  seconds to wait for a service to answer (default 90)
#   OUTBOX_PG_PORT, OUTBOX_REDIS_PORT, OUTBOX_KAFKA_PORT, OUTBOX_KAFKA_CONTROLLER_PORT
#                        ports (defaults 5433, 6380, 9092, 9093); with OUTBOX_SERVICES_DIR they
#                        let two independent sets of services run side by side
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

# ---------------------------------------------------------------- commands
print_exports() {  # print_exports -> export lines for env-provided or our running services; rc 1 if any missing
  local rc=0
  if [ -n "${DATABASE_URL:-}" ]; then printf 'export DATABASE_URL=%q\n' "$DATABASE_URL"
  elif find_pg_bin && pg_running; then printf 'export DATABASE_URL=%s\n' "$OWN_DATABASE_URL"
  else log "PostgreSQL is not running"; rc=1; fi
  if [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then printf 'export KAFKA_BOOTSTRAP_SERVERS=%q\n' "$KAFKA_BOOTSTRAP_SERVERS"
  elif kafka_running; then printf 'export KAFKA_BOOTSTRAP_SERVERS=%s\n' "$OWN_KAFKA_BOOTSTRAP_SERVERS"
  else log "Kafka is not running"; rc=1; fi
  if [ -n "${REDIS_URL:-}" ]; then printf 'export REDIS_URL=%q\n' "$REDIS_URL"
  elif redis_running; then printf 'export REDIS_URL=%s\n' "$OWN_REDIS_URL"
  else log "Redis is not running"; rc=1; fi
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
    print_exports >&3
    return 0
  fi
  lock_state
  [ -n "${REDIS_URL:-}" ] && log "REDIS_URL set: not starting Redis" || start_redis
  [ -n "${DATABASE_URL:-}" ] && log "DATABASE_URL set: not starting PostgreSQL" || start_postgres
  [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ] && log "KAFKA_BOOTSTRAP_SERVERS set: not starting Kafka" || start_kafka
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
  if pid="$(kafka_pid)" && port_open "$KAFKA_PORT"; then echo "kafka:    running ($HOST:$KAFKA_PORT, pid $pid, Kafka $KAFKA_VERSION KRaft)"
  elif [ -n "${pid:-}" ]; then echo "kafka:    starting (pid $pid, port $KAFKA_PORT not open)"; rc=1
  else echo "kafka:    stopped"; rc=1; fi
  return $rc
}

cmd_down() {
  local purge=0
  case "${1:-}" in --purge|purge) purge=1 ;; "") ;; *) die "unknown option for down: $1" ;; esac
  [ -d "$STATE" ] && lock_state
  stop_kafka
  stop_redis
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
    stop-kafka)     lock_state; stop_kafka ;;
    start-kafka)    lock_state; exec 1>&2; start_kafka ;;
    stop-postgres)  lock_state; stop_postgres ;;
    start-postgres) lock_state; exec 1>&2; start_postgres ;;
    -h|--help|help|"") usage ;;
    *) log "unknown command: $cmd"; usage ;;
  esac
}

main "$@"
