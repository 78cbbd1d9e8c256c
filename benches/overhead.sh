#!/usr/bin/env bash
# The overhead benchmark: what corral costs per request against its floor (the smallest hyper
# proxy that does corral's data path's job), against going direct, and against haproxy.
#
#   benches/overhead.sh            # builds corral and the floor (cargo build --release), runs
#   ROUNDS=3 benches/overhead.sh   # the figures the docs give: medians of three rounds
#
# nginx answers POST /v1/chat/completions with a static JSON (benches/overhead/nginx.conf.in).
# Three phases, all against the same nginx:
#
# 1. Closed loop, per round: wrk (64 connections, 2 threads) POSTs a ~1 KB chat-completions
#    request (benches/overhead/payload.json, benches/overhead/post.lua), interleaved:
#      direct                    wrk -> nginx
#      haproxy                   wrk -> haproxy (retries 3, retry-on all-retryable-errors) -> nginx
#      corral (default logging)  wrk -> corral on the config `--upstream http://nginx/v1` makes
#                                (plus drain_delay = "0s" to stop at once), info logging -> nginx
#      floor                     wrk -> benches/overhead/floor (hyper 1 + hyper-util: body
#                                buffered, response streamed, pooled client, mimalloc, fat LTO;
#                                its own crate and lock file) -> nginx
#      floor + duties            the floor with `duties`: per request a copy of the headers kept
#                                to replay, a per-try timeout (tokio's time driver on), the
#                                attempt timed: what any proxy that retries and bounds each try
#                                pays, so what corral costs beyond it is corral's own
#      corral (RUST_LOG=warn), corral (access_log = all), and with CORRAL_BEFORE_BIN the older
#      corral's two cases: the same
#    Each case gets a 2 s warm-up, then a measured run; each proxy is started fresh for its case
#    and stopped after it. Each round starts further on in the list of cases (by its length
#    over ROUNDS), so the machine's drift within a round falls on every case in turn. Per
#    proxy: requests/s, p50 and p99 latency (wrk), CPU microseconds per request (utime + stime
#    from /proc/PID/stat across the measured run, all threads, divided by the requests wrk
#    completed) and peak RSS (VmHWM; each proxy is one process).
#    The report has each case's medians, a round-by-round table (haproxy / corral / floor) and
#    the targets against the floor.
# 2. Open loop, per round (needs oha: `cargo install oha --locked`): direct, the floor and
#    corral on its default config at each rate of OPEN_RATES (1000 5000 requests/s), oha -q
#    RATE --latency-correction -c64 for OPEN_DURATION: p50 and p99, and the latency each proxy
#    adds over direct in the same round. wrk's closed loop sends less to a slower proxy and
#    hides its queueing; a fixed rate does not.
# 3. Instructions (needs valgrind and oha): the floor and corral under callgrind, counting
#    exactly INSTR_REQUESTS requests after a warm-up: user-space instructions per request, a
#    figure this machine's drifting speed does not move. Also the floor with `duties` (its
#    third argument): per request, a copy of the headers kept to replay, a per-try timeout
#    (tokio's time driver on) and the attempt timed, what any proxy that retries and bounds
#    each try pays; the rest of corral's difference is its own.
#
# Fairness: nginx runs one process with one event loop, the same fixed upstream for every case.
# haproxy (one thread per CPU, its 2.6 default), corral and the floor (one tokio worker per CPU)
# keep their thread defaults; haproxy logs nothing, like corral at RUST_LOG=warn. All keep client
# and upstream connections alive.
#
# wrk, nginx, the proxy and the machine's other work share the same cores, so only the ratios
# within one run mean anything. Before each case the script waits (up to QUIET_WAIT seconds in
# all) for other processes to leave the machine mostly idle, and the notes give each case's load
# average and the CPU share other processes took during it, with a warning above 10%.
#
# Environment: CORRAL_BIN and FLOOR_BIN (skip the builds and use these binaries),
# CORRAL_BEFORE_BIN (an older corral, measured too, as "before: ..."), ROUNDS (1; every case
# runs once per round, rounds one after another, and the tables give each case's median; this
# machine's speed drifts from minute to minute, so compare within one run, with ROUNDS=3 or
# more), CARGO_TARGET_DIR, DURATION (10s), WARMUP (2s), CONNECTIONS (64), THREADS (2),
# QUIET_WAIT (20), OPEN_RATES ("1000 5000"), OPEN_DURATION (10s), INSTR_REQUESTS (2000), OHA
# (path to oha), OUT (bench-out/overhead.md).
# Takes about 3 minutes a round after the builds, plus about a minute for the instructions.
# Needs: apt-get install wrk nginx-light haproxy curl (and valgrind for phase 3); oha for
# phases 2 and 3. Everything listens on 127.0.0.1 only.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"

DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
OUT=${OUT:-bench-out/overhead.md}
ROUNDS=${ROUNDS:-1}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "overhead.sh: ROUNDS must be a whole number >= 1" >&2; exit 1; }

die() {
    echo "overhead.sh: $*" >&2
    exit 1
}

# ----- prerequisites -----

find_tool() { # name -> path on PATH or in the sbin directories, or nothing
    command -v "$1" 2>/dev/null || { for d in /usr/sbin /sbin /usr/local/sbin; do
        [[ -x $d/$1 ]] && { echo "$d/$1"; return 0; }
    done; }
}
missing=()
WRK=$(find_tool wrk) || true
NGINX=$(find_tool nginx) || true
HAPROXY=$(find_tool haproxy) || true
CURL=$(find_tool curl) || true
# oha (crates.io: `cargo install oha --locked`) keeps a fixed request rate for the open-loop
# phase; without it that phase is skipped, and the report says so.
OHA=${OHA:-$(find_tool oha)} || true
[[ -n $WRK ]] || missing+=("wrk (package wrk)")
[[ -n $NGINX ]] || missing+=("nginx (package nginx-light or nginx)")
[[ -n $HAPROXY ]] || missing+=("haproxy (package haproxy)")
[[ -n $CURL ]] || missing+=("curl (package curl)")
if ((${#missing[@]})); then
    printf 'overhead.sh: missing %s\n' "${missing[@]}" >&2
    die "install them with: apt-get install wrk nginx-light haproxy curl"
fi
[[ -r /proc/self/stat ]] || die "needs Linux /proc"
for f in nginx.conf.in haproxy.cfg.in post.lua payload.json; do
    [[ -f $here/overhead/$f ]] || die "missing benches/overhead/$f"
done

if [[ -n ${CORRAL_BIN:-} ]]; then
    CORRAL=$CORRAL_BIN
else
    command -v cargo >/dev/null || die "cargo not found (or set CORRAL_BIN to a built corral)"
    echo "building corral (cargo build --release)..." >&2
    cargo build --release --quiet || die "cargo build --release failed"
    CORRAL=${CARGO_TARGET_DIR:-target}/release/corral
fi
[[ -x $CORRAL ]] || die "corral binary not found at $CORRAL"

# The floor: the smallest hyper 1 / hyper-util reverse proxy that does what corral's data path
# must (benches/overhead/floor, its own crate and lock file, the same allocator and profile).
if [[ -n ${FLOOR_BIN:-} ]]; then
    FLOOR=$FLOOR_BIN
else
    echo "building the floor (benches/overhead/floor, cargo build --release)..." >&2
    CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}/floor cargo build --release --quiet --locked \
        --manifest-path "$here/overhead/floor/Cargo.toml" || die "building the floor failed"
    FLOOR=${CARGO_TARGET_DIR:-$root/target}/floor/release/floor
fi
[[ -x $FLOOR ]] || die "floor binary not found at $FLOOR"

# ----- processes: every one we start is recorded and killed by PID on exit -----

TMP=$(mktemp -d "${TMPDIR:-/tmp}/corral-overhead.XXXXXX")
PIDS=()
# Run a private copy: a concurrent `cargo build` may replace target/release/corral mid-run.
cp "$CORRAL" "$TMP/corral"
cp "$FLOOR" "$TMP/floor"
FLOOR=$TMP/floor
CORRAL_SRC=$CORRAL
CORRAL=$TMP/corral
BEFORE=""
if [[ -n ${CORRAL_BEFORE_BIN:-} ]]; then
    [[ -x $CORRAL_BEFORE_BIN ]] || die "CORRAL_BEFORE_BIN: no binary at $CORRAL_BEFORE_BIN"
    cp "$CORRAL_BEFORE_BIN" "$TMP/corral-before"
    BEFORE=$TMP/corral-before
fi

alive() { # pid: running (not gone, not a zombie waiting to be reaped)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}
stop_pid() { # pid: TERM, up to 2 s, then KILL
    local pid=$1 i
    if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 40; i++)); do
            alive "$pid" || break
            sleep 0.05
        done
        if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
    fi
    wait "$pid" 2>/dev/null || true
    # Reaped: forget it, so the exit trap never signals a PID the system has since reused.
    local kept=() p
    for p in "${PIDS[@]}"; do [[ $p == "$pid" ]] || kept+=("$p"); done
    PIDS=("${kept[@]}")
}
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() { # log-file command... ; sets STARTED to the PID (the command itself, no wrapper)
    "${@:2}" >"$1" 2>&1 &
    STARTED=$!
    PIDS+=("$STARTED")
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
USED_PORTS=" "
# Below the kernel's ephemeral range: a port picked free there can be taken by the next
# outgoing connection (wrk's, a proxy's to nginx) before its server binds it.
EPHEMERAL_LOW=$(awk '{print $1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
((EPHEMERAL_LOW > 12000)) || EPHEMERAL_LOW=32768
pick_port() { # variable-name: a free port on 127.0.0.1, distinct from those picked before
    local p i
    for ((i = 0; i < 200; i++)); do
        p=$((10000 + RANDOM % (EPHEMERAL_LOW - 10000)))
        [[ $USED_PORTS == *" $p "* ]] && continue
        port_busy "$p" && continue
        USED_PORTS+="$p "
        printf -v "$1" '%s' "$p"
        return 0
    done
    die "no free port found"
}

wait_listening() { # port pid name log
    local i
    for ((i = 0; i < 200; i++)); do
        kill -0 "$2" 2>/dev/null || { cat "$4" >&2; die "$3 exited at startup (log above)"; }
        port_busy "$1" && return 0
        sleep 0.05
    done
    cat "$4" >&2
    die "$3 did not listen on 127.0.0.1:$1 within 10 s"
}

check_answer() { # url name: one POST must come back 200 with nginx's JSON
    local code
    code=$("$CURL" -sS -o "$TMP/answer" -w '%{http_code}' --max-time 5 \
        -H 'content-type: application/json' --data-binary "@$here/overhead/payload.json" "$1") ||
        die "$2: request to $1 failed"
    [[ $code == 200 ]] && grep -q chatcmpl-overhead "$TMP/answer" ||
        die "$2: expected 200 with nginx's JSON from $1, got $code: $(head -c 300 "$TMP/answer")"
}

# ----- measurements -----

CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() { # pid -> utime + stime (all threads), in clock ticks
    local stat
    stat=$(<"/proc/$1/stat")
    stat=${stat##*) } # fields from 3 (state) on; comm may contain spaces
    awk '{ print $12 + $13 }' <<<"$stat"
}
hwm_kib() { awk '/^VmHWM:/ { print $2 }' "/proc/$1/status"; }
threads_of() { awk '/^Threads:/ { print $2 }' "/proc/$1/status"; }
host_cpu() { # -> "busy total" jiffies over all CPUs
    awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t }' /proc/stat
}
to_ms() { # wrk latency ("812.00us", "1.23ms", "2.01s") -> ms
    awk -v v="$1" 'BEGIN {
        if (v ~ /us$/) { sub(/us$/, "", v); print v / 1000 }
        else if (v ~ /ms$/) { sub(/ms$/, "", v); print v + 0 }
        else if (v ~ /m$/) { sub(/m$/, "", v); print v * 60000 }
        else if (v ~ /s$/) { sub(/s$/, "", v); print v * 1000 }
        else print "nan" }'
}

# Before each case, wait (QUIET_WAIT seconds in all, default 20) until other processes leave at
# least ~3/4 of the machine idle: a concurrent compile halves a proxy's throughput.
QUIET_LEFT=${QUIET_WAIT:-20}
QUIET_WAITED=0
wait_quiet() {
    local a b busy
    while :; do
        a=$(host_cpu)
        sleep 0.5
        b=$(host_cpu)
        busy=$(awk -v a="$a" -v b="$b" 'BEGIN { split(a, x, " "); split(b, y, " ");
            printf "%.0f", 100 * (y[1] - x[1]) / (y[2] - x[2] + 1e-9) }')
        ((busy <= 25)) && return 0
        if ((QUIET_LEFT <= 0)); then
            echo "  (machine still ${busy}% busy with other work; measuring anyway)" >&2
            return 0
        fi
        ((QUIET_LEFT -= 1, QUIET_WAITED += 1))
        sleep 0.5
    done
}

run_wrk() { # duration url out-file [--latency]
    OVERHEAD_PAYLOAD="$here/overhead/payload.json" timeout 60 "$WRK" -t"$THREADS" \
        -c"$CONNECTIONS" -d"$1" ${4:-} -s "$here/overhead/post.lua" "$2" >"$3" 2>&1 ||
        { cat "$3" >&2; die "wrk failed against $2"; }
}

declare -A RPS P50 P99 CPU RSS ERR LOAD BUSY FOREIGN NGINX_CPU THR EXTRA
CASES=()

# measure name url proxy-pid|"" : warm up, then the measured run; fills the arrays above.
measure() {
    local name=$1 url=$2 pid=$3 out c seen="" i=0
    for c in "${CASES[@]}"; do [[ $c == "$name" ]] && seen=1 && break; ((i += 1)); done
    [[ -n $seen ]] || CASES+=("$name")
    out="$TMP/wrk-$ROUND-$i.txt"
    check_answer "$url" "$name"
    wait_quiet
    run_wrk "$WARMUP" "$url" "$TMP/warmup.txt"
    LOAD[$name]=$(cut -d' ' -f1-3 /proc/loadavg)
    local c0="" c1=0 n0 n1 h0 h1 reqs
    [[ -n $pid ]] && c0=$(cpu_ticks "$pid")
    n0=$(cpu_ticks "$NGINX_PID")
    h0=$(host_cpu)
    local TIMEFORMAT='%U %S' # wrk's own CPU seconds, from bash's `time`
    { time run_wrk "$DURATION" "$url" "$out" --latency; } 2>"$TMP/wrk-time.txt"
    h1=$(host_cpu)
    n1=$(cpu_ticks "$NGINX_PID")
    [[ -n $pid ]] && c1=$(cpu_ticks "$pid")
    reqs=$(awk '/ requests in / { print $1 }' "$out")
    [[ -n $reqs && $reqs -gt 0 ]] || { cat "$out" >&2; die "$name: wrk completed no requests"; }
    # One value per round, space-separated; `summarize` takes the medians.
    RPS[$name]+="$(awk '/^Requests\/sec:/ { print $2 }' "$out") "
    P50[$name]+="$(to_ms "$(awk '$1 == "50%" { print $2 }' "$out")") "
    P99[$name]+="$(to_ms "$(awk '$1 == "99%" { print $2 }' "$out")") "
    ERR[$name]+="$(awk '/Non-2xx or 3xx responses:/ { n += $NF }
        /Socket errors:/ { gsub(/,/, ""); n += $4 + $6 + $8 + $10 } END { print n + 0 }' "$out") "
    BUSY[$name]=$(awk -v a="$h0" -v b="$h1" 'BEGIN { split(a, x, " "); split(b, y, " ");
        printf "%.0f", 100 * (y[1] - x[1]) / (y[2] - x[2]) }')
    # CPU the rest of the machine (not wrk, nginx or the proxy) used during the run, as a share
    # of all cores: other work competing with this case.
    FOREIGN[$name]+="$(awk -v a="$h0" -v b="$h1" -v ours=$((n1 - n0 + c1 - ${c0:-0})) \
        -v wrk="$(cat "$TMP/wrk-time.txt")" -v hz="$CLK_TCK" 'BEGIN { split(a, x, " ");
        split(b, y, " "); split(wrk, w, " "); f = (y[1] - x[1]) - ours - (w[1] + w[2]) * hz;
        printf "%.0f", f < 0 ? 0 : 100 * f / (y[2] - x[2]) }') "
    NGINX_CPU[$name]+="$(awk -v d=$((n1 - n0)) -v r="$reqs" -v hz="$CLK_TCK" \
        'BEGIN { printf "%.1f", d / hz * 1e6 / r }') "
    if [[ -n $pid ]]; then
        CPU[$name]+="$(awk -v d=$((c1 - c0)) -v r="$reqs" -v hz="$CLK_TCK" \
            'BEGIN { printf "%.1f", d / hz * 1e6 / r }') "
        RSS[$name]+="$(awk -v k="$(hwm_kib "$pid")" 'BEGIN { printf "%.1f", k / 1024 }') "
        THR[$name]=$(threads_of "$pid")
    fi
    echo "  round $ROUND, $name: $(awk '/^Requests\/sec:/ { print $2 }' "$out") req/s" >&2
}

median() { tr ' ' '\n' <<<"$1" | awk 'NF' | sort -g | awk '{ v[NR] = $1 } END {
    if (NR == 0) print ""; else if (NR % 2) print v[(NR + 1) / 2];
    else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
maximum() { tr ' ' '\n' <<<"$1" | awk 'NF' | sort -g | tail -1; }
total() { tr ' ' '\n' <<<"$1" | awk '{ n += $1 } END { print n + 0 }'; }

# Each case's rounds to one figure: medians of rate, latency and CPU (the machine's speed
# varies from one minute to the next), the peak RSS, the share of other work at its highest,
# the errors summed. The rounds themselves stay in ROUNDS_RPS for the notes.
declare -A ROUNDS_RPS ROUNDS_CPU ROUNDS_P99
summarize() {
    local n
    for n in "${CASES[@]}"; do
        ROUNDS_RPS[$n]=${RPS[$n]}
        ROUNDS_CPU[$n]=${CPU[$n]:-}
        ROUNDS_P99[$n]=${P99[$n]}
        RPS[$n]=$(median "${RPS[$n]}")
        P50[$n]=$(median "${P50[$n]}")
        P99[$n]=$(median "${P99[$n]}")
        NGINX_CPU[$n]=$(median "${NGINX_CPU[$n]}")
        [[ -z ${CPU[$n]:-} ]] || CPU[$n]=$(median "${CPU[$n]}")
        [[ -z ${RSS[$n]:-} ]] || RSS[$n]=$(maximum "${RSS[$n]}")
        FOREIGN[$n]=$(maximum "${FOREIGN[$n]}")
        ERR[$n]=$(total "${ERR[$n]}")
    done
}

# What corral's own metrics say about the run: was the learned limit still pacing?
corral_notes() { # name port log
    local m
    m=$("$CURL" -sS --max-time 5 "http://127.0.0.1:$2/metrics") || return 0
    EXTRA[$1]=$(awk -v lines="$(wc -l <"$3")" '
        /^corral_limit_source\{/ && /kind="requests"/ && $NF == 1 {
            match($0, /source="[^"]*"/); src = substr($0, RSTART + 8, RLENGTH - 9) }
        /^corral_rate_limit_wait_seconds_sum/ { wsum = $NF }
        /^corral_rate_limit_wait_seconds_count/ { wcount = $NF }
        /^corral_retries_total\{/ { retries += $NF }
        /^corral_rate_limit_wait_seconds_bucket/ && /le="0.001"/ { w1ms = $NF }
        /^corral_learned_burst\{/ && /kind="requests"/ { burst = $NF }
        /^corral_queue_wait_seconds_sum/ { qsum = $NF }
        END { printf "pacing source `%s` (learned burst %d), rate-limit wait mean %.0f µs over " \
            "%d attempts (%.1f%% under 1 ms), queue wait %.3f s, %d retries, %d log lines",
            src, burst, 1e6 * wsum / wcount, wcount, 100 * w1ms / wcount, qsum, retries, lines }
    ' <<<"$m")
}

# ----- run -----

pick_port NGINX_PORT
pick_port HAPROXY_PORT
pick_port CORRAL_PORT
pick_port FLOOR_PORT

user_line=""
[[ $(id -u) == 0 ]] && user_line="user $(id -un) $(id -gn);" # workers keep our user
temp_paths=""
nginx_v=$("$NGINX" -V 2>&1)
for m in client_body proxy fastcgi uwsgi scgi; do
    flag=--http-${m//_/-}-temp-path
    [[ $m == client_body || ($nginx_v == *"$flag"* && $nginx_v != *"--without-http_${m}_module"*) ]] &&
        temp_paths+="${m}_temp_path $TMP/$m; "
done
sed -e "s|@TMP@|$TMP|g" -e "s|@PORT@|$NGINX_PORT|g" -e "s|@USER@|$user_line|" \
    -e "s|@TEMP_PATHS@|$temp_paths|" "$here/overhead/nginx.conf.in" >"$TMP/nginx.conf"
sed -e "s|@PORT@|$HAPROXY_PORT|g" -e "s|@UPSTREAM_PORT@|$NGINX_PORT|g" \
    "$here/overhead/haproxy.cfg.in" >"$TMP/haproxy.cfg"
"$NGINX" -e "$TMP/nginx-error.log" -p "$TMP" -c "$TMP/nginx.conf" -t >"$TMP/nginx-t.log" 2>&1 ||
    { cat "$TMP/nginx-t.log" >&2; die "nginx rejected its config"; }
"$HAPROXY" -c -f "$TMP/haproxy.cfg" >"$TMP/haproxy-c.log" 2>&1 ||
    { cat "$TMP/haproxy-c.log" >&2; die "haproxy rejected its config"; }

started_at=$(date -u '+%Y-%m-%d %H:%M:%S UTC')
uptime_before=$(uptime)
echo "overhead: wrk -t$THREADS -c$CONNECTIONS -d$DURATION (after a $WARMUP warm-up) per case" >&2

start "$TMP/nginx.log" "$NGINX" -e "$TMP/nginx-error.log" -p "$TMP" -c "$TMP/nginx.conf"
NGINX_PID=$STARTED
wait_listening "$NGINX_PORT" "$NGINX_PID" nginx "$TMP/nginx-error.log"

# A corral case: start `binary` (name, log, port, binary, args...), measure, stop.
corral_case() {
    local name=$1 log=$2 port=$3
    start "$log" "${@:4}"
    pid=$STARTED
    wait_listening "$port" "$pid" corral "$log"
    measure "$name" "http://127.0.0.1:$port/v1/chat/completions" "$pid"
    corral_notes "$name" "$port" "$log"
    stop_pid "$pid"
}

# The closed-loop cases, one function each, so that a round can take them in any order.
case_direct() {
    measure direct "http://127.0.0.1:$NGINX_PORT/v1/chat/completions" ""
}
case_haproxy() {
    start "$TMP/haproxy.log" "$HAPROXY" -db -f "$TMP/haproxy.cfg"
    pid=$STARTED
    wait_listening "$HAPROXY_PORT" "$pid" haproxy "$TMP/haproxy.log"
    measure haproxy "http://127.0.0.1:$HAPROXY_PORT/v1/chat/completions" "$pid"
    stop_pid "$pid"
}
case_floor() { # [duties]
    local name=floor log="$TMP/floor.log"
    [[ -z ${1:-} ]] || { name="floor + duties" log="$TMP/floor-duties.log"; }
    start "$log" "$FLOOR" "127.0.0.1:$FLOOR_PORT" "127.0.0.1:$NGINX_PORT" ${1:+"$1"}
    pid=$STARTED
    wait_listening "$FLOOR_PORT" "$pid" "$name" "$log"
    measure "$name" "http://127.0.0.1:$FLOOR_PORT/v1/chat/completions" "$pid"
    stop_pid "$pid"
}
case_floor_duties() { case_floor duties; }
case_corral() { # corral|before info|warn|all: the binary, then its logging or its config
    local bin=$CORRAL prefix="" logging=(env -u RUST_LOG) config="$TMP/corral.toml" what
    [[ $1 == corral ]] || { bin=$BEFORE prefix="before: "; }
    case $2 in
        info) what="default logging" ;;
        warn) what="RUST_LOG=warn" logging=(env RUST_LOG=warn) ;;
        all) what="access_log = all" config="$TMP/corral-all.toml" ;;
    esac
    corral_case "${prefix}corral ($what)" "$TMP/$1-$2.log" "$CORRAL_PORT" \
        "${logging[@]}" "$bin" --config "$config"
}

run_round() {
    # What `corral --upstream URL` runs, plus `drain_delay = "0s"`: stopped by SIGTERM at once
    # instead of serving on for the 5 s a load balancer needs (and being killed).
    printf 'listen = "127.0.0.1:%s"\ndrain_delay = "0s"\n[[upstream]]\nname = "openai"\nroute = "/v1"\nbase_url = "http://127.0.0.1:%s/v1"\n' \
        "$CORRAL_PORT" "$NGINX_PORT" >"$TMP/corral.toml"
    { echo 'access_log = "all"'; cat "$TMP/corral.toml"; } >"$TMP/corral-all.toml"
    local cases=(case_direct case_haproxy "case_corral corral info" case_floor case_floor_duties
        "case_corral corral warn" "case_corral corral all") k
    [[ -z $BEFORE ]] || cases+=("case_corral before warn" "case_corral before info")
    # Each round starts further on in the list, by its length over the rounds: this machine's
    # speed drifts within a round (nginx's own CPU per request, the same work in every case,
    # has risen by four fifths from a round's first case to its last), and a case always
    # measured early or late would carry that drift into every round's figure and so into its
    # median. (A step of one case a round left the last cases in the later half of every
    # round of four.) The tables keep the first round's order.
    local n=${#cases[@]} step=$((${#cases[@]} / ROUNDS > 1 ? ${#cases[@]} / ROUNDS : 1))
    for ((k = 0; k < n; k++)); do
        # A case is a function's name and its words.
        ${cases[$(((k + (ROUND - 1) * step) % n))]}
    done
}

# ----- open loop: added latency at a fixed request rate -----
#
# wrk runs closed loop: each connection sends its next request when the last is answered, so a
# slow proxy is offered less load and its queueing hides (coordinated omission). Users compare
# gateways by the latency they add at a given rate, so this phase offers each case the same
# rate whatever it answers: oha -q RATE with --latency-correction (each request's latency runs
# from when it was due, not from when a connection was free to send it).
OPEN_RATES=${OPEN_RATES:-1000 5000}
OPEN_DURATION=${OPEN_DURATION:-10s}
declare -A OPEN_P50 OPEN_P99 OPEN_RPS OPEN_ERR
OPEN_CASES=(direct floor corral)

cat >"$TMP/oha_figures.py" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
lat = d["latencyPercentiles"]
codes = d.get("statusCodeDistribution", {})
# Requests still in flight when -z ends are "aborted due to deadline": the run's end, not errors.
errors = sum(n for e, n in d.get("errorDistribution", {}).items() if e != "aborted due to deadline")
bad = sum(n for code, n in codes.items() if code != "200") + errors
print(f"{lat['p50'] * 1e3:.3f} {lat['p99'] * 1e3:.3f} {d['summary']['requestsPerSec']:.0f} {bad}")
PY

open_measure() { # name url rate
    local out="$TMP/oha-$ROUND-$3-$1.json" key="$1@$3" figures
    check_answer "$2" "$1"
    wait_quiet
    oha_run "$WARMUP" "$2" "$3" "$TMP/oha-warmup.json"
    oha_run "$OPEN_DURATION" "$2" "$3" "$out"
    # p50 p99 (ms), answered per second, answers that were not 200 plus errors.
    figures=$(python3 "$TMP/oha_figures.py" "$out"
    ) || die "$1 at $3/s: could not read oha's JSON ($out)"
    read -r p50 p99 rps bad <<<"$figures"
    OPEN_P50[$key]+="$p50 "
    OPEN_P99[$key]+="$p99 "
    OPEN_RPS[$key]+="$rps "
    OPEN_ERR[$key]+="$bad "
    echo "  round $ROUND, $1 at $3/s: p50 $p50 ms, p99 $p99 ms" >&2
}

oha_run() { # duration url rate out-file
    timeout 120 "$OHA" --no-tui --output-format json --latency-correction -z "$1" -q "$3" \
        -c "$CONNECTIONS" -m POST -H 'content-type: application/json' \
        -D "$here/overhead/payload.json" "$2" >"$4" 2>"$4.err" ||
        { cat "$4.err" >&2; die "oha failed against $2"; }
}

open_round() {
    local rate plain="$TMP/corral.toml"
    for rate in $OPEN_RATES; do
        open_measure direct "http://127.0.0.1:$NGINX_PORT/v1/chat/completions" "$rate"
        start "$TMP/floor.log" "$FLOOR" "127.0.0.1:$FLOOR_PORT" "127.0.0.1:$NGINX_PORT"
        pid=$STARTED
        wait_listening "$FLOOR_PORT" "$pid" floor "$TMP/floor.log"
        open_measure floor "http://127.0.0.1:$FLOOR_PORT/v1/chat/completions" "$rate"
        stop_pid "$pid"
        start "$TMP/corral-open.log" env -u RUST_LOG "$CORRAL" --config "$plain"
        pid=$STARTED
        wait_listening "$CORRAL_PORT" "$pid" corral "$TMP/corral-open.log"
        open_measure corral "http://127.0.0.1:$CORRAL_PORT/v1/chat/completions" "$rate"
        stop_pid "$pid"
    done
}

for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    run_round
    [[ -z $OHA ]] || open_round
done

# ----- instructions per request (callgrind) -----
#
# Time on this shared machine drifts by a third from one minute to the next; instructions do
# not. Each proxy runs under valgrind's callgrind with counting off, takes a warm-up, then
# counts exactly INSTR_REQUESTS requests (oha -n, 4 connections): user-space instructions per
# request, the kernel's excluded. Needs valgrind (Debian package) and oha.
INSTR_REQUESTS=${INSTR_REQUESTS:-2000}
VALGRIND=$(find_tool valgrind) || true
declare -A INSTR
instructions() { # name command... ; the proxy must listen on INSTR_PORT
    local name=$1 out="$TMP/callgrind-${1//[^a-z]/_}.out" vpid i total
    shift
    start "$out.log" "$VALGRIND" --tool=callgrind --instr-atstart=no \
        --callgrind-out-file="$out" "$@"
    vpid=$STARTED
    for ((i = 0; i < 200; i++)); do
        "$CURL" -s -o /dev/null --max-time 2 -XPOST -H 'content-type: application/json' \
            --data-binary "@$here/overhead/payload.json" \
            "http://127.0.0.1:$INSTR_PORT/v1/chat/completions" && break
        sleep 0.2
    done
    "$OHA" --no-tui -n 200 -c 4 -m POST -H 'content-type: application/json' \
        -D "$here/overhead/payload.json" "http://127.0.0.1:$INSTR_PORT/v1/chat/completions" >/dev/null
    callgrind_control -i on "$vpid" >/dev/null
    "$OHA" --no-tui -n "$INSTR_REQUESTS" -c 4 -m POST -H 'content-type: application/json' \
        -D "$here/overhead/payload.json" "http://127.0.0.1:$INSTR_PORT/v1/chat/completions" >/dev/null
    callgrind_control -d "$vpid" >/dev/null
    stop_pid "$vpid"
    # The dump on request is the first part file; the rest is the exit's.
    total=$(awk '/^summary:|^totals:/ { print $2; exit }' "$out.1") ||
        die "$name: no callgrind dump at $out.1"
    INSTR[$name]=$(awk -v t="$total" -v n="$INSTR_REQUESTS" 'BEGIN { printf "%.0f", t / n }')
    echo "  $name: ${INSTR[$name]} instructions a request" >&2
}
if [[ -n $VALGRIND && -n $OHA ]]; then
    pick_port INSTR_PORT
    instructions floor "$FLOOR" "127.0.0.1:$INSTR_PORT" "127.0.0.1:$NGINX_PORT"
    instructions "floor + duties" "$FLOOR" "127.0.0.1:$INSTR_PORT" "127.0.0.1:$NGINX_PORT" duties
    sed "s|^listen = .*|listen = \"127.0.0.1:$INSTR_PORT\"|" "$TMP/corral.toml" >"$TMP/corral-instr.toml"
    # Not through `env`: callgrind would count `env` and let the program it runs go uncounted.
    RUST_LOG=warn instructions corral "$CORRAL" --config "$TMP/corral-instr.toml"
    [[ -z $BEFORE ]] ||
        RUST_LOG=warn instructions "before: corral" "$BEFORE" --config "$TMP/corral-instr.toml"
fi
RSS_NGINX=$(awk -v k="$(hwm_kib "$NGINX_PID")" 'BEGIN { printf "%.1f", k / 1024 }')
summarize
uptime_after=$(uptime)

# ----- report -----

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f%%", 100 * a / b }'; }
minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%+.2f", a - b }'; }
verdict() { awk -v ok="$1" 'BEGIN { print (ok ? "met" : "MISSED") }'; }

report() {
    local n
    echo "## corral overhead benchmark"
    echo
    echo "- date: $started_at"
    echo "- machine: $(nproc) CPUs, $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)," \
        "$(uname -sr)"
    echo "- versions: $("$WRK" -v 2>&1 | head -1 | cut -d' ' -f1-2), $("$NGINX" -v 2>&1 | cut -d' ' -f3)," \
        "$("$HAPROXY" -v | head -1 | cut -d' ' -f1-3), $("$CORRAL" --version) ($CORRAL_SRC," \
        "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
            [[ -z $(git status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null) ]] ||
                echo ", src/ with uncommitted changes"))"
    echo "- load: before \`$(sed 's/^ *//' <<<"$uptime_before")\`; after \`$(sed 's/^ *//' <<<"$uptime_after")\`"
    echo "- rounds: $ROUNDS (figures are each case's median; req/s per round in the notes)"
    echo "- workload: wrk -t$THREADS -c$CONNECTIONS -d$DURATION --latency after a $WARMUP warm-up," \
        "POST $(($(wc -c <"$here/overhead/payload.json") - 1)) B JSON to /v1/chat/completions;" \
        "nginx answers a static $(sed -n "s/.*return 200 '\(.*\)';/\1/p" "$here/overhead/nginx.conf.in" |
            tr -d '\n' | wc -c) B JSON"
    echo
    echo "| run | req/s | p50 ms | p99 ms | CPU µs/req | peak RSS MiB | vs direct | vs haproxy | vs floor | p99 − floor ms | errors |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for n in "${CASES[@]}"; do
        printf '| %s | %.0f | %.3f | %.3f | %s | %s | %s | %s | %s | %s | %s |\n' "$n" "${RPS[$n]}" \
            "${P50[$n]}" "${P99[$n]}" "${CPU[$n]:-—}" "${RSS[$n]:-—}" \
            "$(ratio "${RPS[$n]}" "${RPS[direct]}")" "$(ratio "${RPS[$n]}" "${RPS[haproxy]}")" \
            "$(ratio "${RPS[$n]}" "${RPS[floor]}")" "$(minus "${P99[$n]}" "${P99[floor]}")" "${ERR[$n]}"
    done
    echo
    echo "Round by round (haproxy / corral on its default config / the floor):"
    echo
    echo "| round | req/s | CPU µs/req | p99 ms |"
    echo "| ---: | --- | --- | --- |"
    local r nth
    nth() { awk -v i="$2" '{ print $i }' <<<"$1"; }
    local c="corral (default logging)"
    for ((r = 1; r <= ROUNDS; r++)); do
        printf '| %d | %.0f / %.0f / %.0f | %s / %s / %s | %s / %s / %s |\n' "$r" \
            "$(nth "${ROUNDS_RPS[haproxy]}" "$r")" "$(nth "${ROUNDS_RPS[$c]}" "$r")" \
            "$(nth "${ROUNDS_RPS[floor]}" "$r")" "$(nth "${ROUNDS_CPU[haproxy]}" "$r")" \
            "$(nth "${ROUNDS_CPU[$c]}" "$r")" "$(nth "${ROUNDS_CPU[floor]}" "$r")" \
            "$(nth "${ROUNDS_P99[haproxy]}" "$r")" "$(nth "${ROUNDS_P99[$c]}" "$r")" \
            "$(nth "${ROUNDS_P99[floor]}" "$r")"
    done
    echo
    echo "CPU µs/req: the proxy process's utime + stime (all threads) over the measured run" \
        "divided by the requests wrk completed. Peak RSS: VmHWM of the proxy's one process" \
        "(haproxy runs without a master, corral is one process); direct has no proxy, nginx's" \
        "figures are in the notes. errors: non-2xx answers plus wrk socket errors."
    echo
    echo "Notes per case (load, host CPU and threads from the last round): 1/5/15-min load average at the start of the measured run; host CPU" \
        "busy over all cores during it, and the part of it used by other processes than wrk," \
        "nginx and the proxy (other work competing with this case); nginx's own CPU per request" \
        "(the same work in every case; it rises when nginx idles between requests):"
    echo
    for n in "${CASES[@]}"; do
        printf -- '- %s: load %s, host CPU %s%% busy (%s%% other processes), nginx %s µs/req' \
            "$n" "${LOAD[$n]}" "${BUSY[$n]}" "${FOREIGN[$n]}" "${NGINX_CPU[$n]}"
        [[ -n ${THR[$n]:-} ]] && printf ', %s threads' "${THR[$n]}"
        [[ $n == direct ]] && printf ', nginx peak RSS %s MiB (one process, one worker loop)' "$RSS_NGINX"
        [[ -n ${EXTRA[$n]:-} ]] && printf '; %s' "${EXTRA[$n]}"
        ((ROUNDS == 1)) || printf '; req/s by round: %s' "$(xargs <<<"${ROUNDS_RPS[$n]}")"
        echo
    done
    echo
    local warnings=""
    for n in "${CASES[@]}"; do
        ((FOREIGN[$n] <= 10)) || warnings+="**Warning**: other processes used ${FOREIGN[$n]}% of the"\
" machine during \`$n\`; the ratios of this run are skewed: run it again on a quiet machine."$'\n'
    done
    ((QUIET_WAITED == 0)) || warnings+="Waited ${QUIET_WAITED} s in all for other work to quiet down."$'\n'
    [[ -z $warnings ]] || printf '%s\n' "$warnings"
    echo "Targets (corral against the floor, medians of this run's rounds):"
    echo
    for n in "corral (default logging)" "corral (RUST_LOG=warn)"; do
        local thr p99d cpu
        thr=$(awk -v a="${RPS[$n]}" -v b="${RPS[floor]}" 'BEGIN { print (a >= 0.95 * b) }')
        p99d=$(awk -v a="${P99[$n]}" -v b="${P99[floor]}" 'BEGIN { print (a - b <= 0.3) }')
        cpu=$(awk -v a="${CPU[$n]}" -v b="${CPU[floor]}" 'BEGIN { print (a <= b + 3) }')
        echo "- $n: throughput $(ratio "${RPS[$n]}" "${RPS[floor]}") of the floor's (>= 95%:" \
            "$(verdict "$thr")); p99 $(minus "${P99[$n]}" "${P99[floor]}") ms vs the floor's" \
            "(<= +0.3 ms: $(verdict "$p99d")); CPU ${CPU[$n]} µs/req vs the floor's ${CPU[floor]}" \
            "(<= +3: $(verdict "$cpu")); peak RSS ${RSS[$n]} MiB (< 20 MiB:" \
            "$(verdict "$(awk -v r="${RSS[$n]}" 'BEGIN { print (r < 20) }')"))"
    done
    [[ -n ${RPS["floor + duties"]:-} ]] || return 0
    echo
    n="floor + duties"
    echo "What a proxy that retries and bounds each try pays beyond the floor (\`$n\`):" \
        "throughput $(ratio "${RPS[$n]}" "${RPS[floor]}") of the floor's, CPU ${CPU[$n]} µs/req;" \
        "corral (RUST_LOG=warn) beyond it: throughput" \
        "$(ratio "${RPS["corral (RUST_LOG=warn)"]}" "${RPS[$n]}") of its, CPU" \
        "$(minus "${CPU["corral (RUST_LOG=warn)"]}" "${CPU[$n]}") µs/req."
}

open_report() {
    echo
    if [[ -z $OHA ]]; then
        echo "Open loop: skipped (no \`oha\` on PATH; \`cargo install oha --locked\` brings it)."
        return
    fi
    echo "### Added latency at a fixed rate (open loop)"
    echo
    echo "oha $("$OHA" --version | awk '{ print $2 }') -q RATE --latency-correction -c$CONNECTIONS" \
        "-z$OPEN_DURATION after a $WARMUP warm-up, the same POST; corral on its default config." \
        "Medians of $ROUNDS round(s); added = the case's figure minus direct's in the same round's median."
    echo
    echo "| rate /s | case | answered /s | p50 ms | p99 ms | added p50 ms | added p99 ms | not 200 |"
    echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    local rate n key d50 d99
    for rate in $OPEN_RATES; do
        d50=$(median "${OPEN_P50[direct@$rate]}")
        d99=$(median "${OPEN_P99[direct@$rate]}")
        for n in "${OPEN_CASES[@]}"; do
            key="$n@$rate"
            printf '| %s | %s | %.0f | %.3f | %.3f | %s | %s | %s |\n' "$rate" "$n" \
                "$(median "${OPEN_RPS[$key]}")" "$(median "${OPEN_P50[$key]}")" \
                "$(median "${OPEN_P99[$key]}")" "$(minus "$(median "${OPEN_P50[$key]}")" "$d50")" \
                "$(minus "$(median "${OPEN_P99[$key]}")" "$d99")" "$(total "${OPEN_ERR[$key]}")"
        done
    done
    echo
    local last=${OPEN_RATES##* } c f
    c=$(median "${OPEN_P99[corral@$last]}")
    f=$(median "${OPEN_P99[floor@$last]}")
    echo "Target: corral's added p99 at $last/s at most 0.3 ms over the floor's: corral − floor =" \
        "$(minus "$c" "$f") ms ($(verdict "$(awk -v a="$c" -v b="$f" 'BEGIN { print (a - b <= 0.3) }')"))."
}

instr_report() {
    echo
    if [[ -z ${INSTR[floor]:-} ]]; then
        echo "Instructions: skipped (needs \`valgrind\` and \`oha\` on PATH)."
        return
    fi
    echo "### Instructions per request (callgrind)"
    echo
    echo "User-space instructions per request over $INSTR_REQUESTS requests (oha -n, 4 connections)" \
        "after a warm-up of 200, counted by valgrind's callgrind; corral with \`RUST_LOG=warn\`." \
        "\"floor + duties\" is the floor doing per request what any proxy that retries and bounds" \
        "each try must (a copy of the headers kept to replay, a per-try timer, the attempt timed):" \
        "what corral costs beyond it is corral's own."
    echo
    echo "| proxy | instructions / request | vs floor |"
    echo "| --- | ---: | ---: |"
    local n
    for n in floor "floor + duties" corral "before: corral"; do
        [[ -n ${INSTR[$n]:-} ]] || continue
        printf '| %s | %s | %s |\n' "$n" "${INSTR[$n]}" "$(ratio "${INSTR[$n]}" "${INSTR[floor]}")"
    done
}

mkdir -p "$(dirname "$OUT")"
{ report; open_report; instr_report; } | tee "$OUT"
echo >&2
echo "written to $OUT" >&2
