#!/usr/bin/env bash
# The load test: corral (the release binary) under 2,000 concurrent connections that
# each POST a 1-8 MB body (mean 4.5 MB, 9 GB offered at once) to an upstream that takes 2 s per
# request; refused clients come back after Retry-After, up to 5 tries. It prints what the
# clients got and corral's peak RSS (VmHWM from /proc/PID/status) against its buffer cap
# (`max_buffered_bytes`), and asserts only that corral survived and never held more than the cap.
#
#   benches/load.sh                 # cargo test --release --test bounds (the #[ignore]d test)
#
# Environment: LOAD_CONNECTIONS (2000), LOAD_CAP_MIB (128), LOAD_SECONDS (150: every client gives
# up by then), MALLOC_* (passed to corral, e.g. MALLOC_MMAP_THRESHOLD_=131072 to see what glibc's
# heap keeps). Everything listens on 127.0.0.1 only. Takes about a minute after the build.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here/.."

# Two sockets per connection on each side, plus corral's to the upstream.
want=$(( ${LOAD_CONNECTIONS:-2000} * 4 + 1024 ))
if (( $(ulimit -n) < want )); then
    ulimit -n "$want" 2>/dev/null || ulimit -n "$(ulimit -Hn)"
fi
echo "load.sh: ulimit -n $(ulimit -n)" >&2

cargo test --release --test bounds load_2000_connections_stay_under_the_buffer_cap \
    -- --ignored --nocapture --test-threads 1
