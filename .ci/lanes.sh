# Suites side by side (sourced by .ci/run and .ci/matrix). They wait far more than they compute
# (about a fifth of a core each), so running them together costs little more than the longest.
#   lane NAME COMMAND...  start COMMAND in the background, its output in $LANE_LOGS/NAME.log
#   wait_lanes [QUIET]    wait for every lane; print each one's summary line (a failed one: its
#                         failures, and its whole output kept in build/ci-logs/NAME.log), except
#                         the lane named QUIET, whose exit status is left in $quiet_status;
#                         returns 1 if any other lane failed.
LANE_LOGS=$(mktemp -d)
LANES=()
quiet_status=0

lane() {
  local name=$1
  shift
  ( "$@" > "$LANE_LOGS/$name.log" 2>&1 ) &
  LANES+=("$name:$!")
}

wait_lanes() {
  local quiet=${1:-} entry name status failed=0 summary
  for entry in "${LANES[@]}"; do
    name=${entry%%:*}
    status=0
    wait "${entry#*:}" || status=$?
    if [ "$name" = "$quiet" ]; then
      quiet_status=$status
      continue
    fi
    if [ "$status" -ne 0 ]; then
      failed=1
      grep -E "^(\[python[0-9.]+\] )?(FAILED|ERROR) |^E  " "$LANE_LOGS/$name.log" | head -n 60 | sed "s/^/[$name] /" || true
      tail -n 20 "$LANE_LOGS/$name.log" | sed "s/^/[$name] /"
      mkdir -p build/ci-logs && cp "$LANE_LOGS/$name.log" "build/ci-logs/$name.log"
      echo "[$name] its whole output: build/ci-logs/$name.log"
    fi
    summary=$(grep -E "(passed|failed|error|skipped)( in |,)" "$LANE_LOGS/$name.log" | tail -n 2 | tr '\n' ' ' || true)
    echo "[$name] exit $status: $summary"
  done
  return "$failed"
}
