#!/usr/bin/env bash
# `kill -9` resume check of `npuc build` on a real pipeline (the large examples: too long for
# the default test suite, whose kill test runs SmolLM2 in seconds).
#
#   scripts/kill-resume.sh PIPELINE.toml [FRACTION...]     (default fraction: 0.5)
#
# Builds PIPELINE.toml once uninterrupted (the reference, timed), then for each FRACTION starts
# a fresh build into its own directory, kills it with SIGKILL at FRACTION of the reference's
# time, re-runs it to the end, and compares every file of the two bundles byte for byte
# (`cmp`). A third run must find every step cached. Exits non-zero on any difference.
# NPUC names the binary (default: target/release/npuc); WORK the scratch directory (default:
# a fresh one under /tmp, removed at the end unless KEEP=1).
set -euo pipefail
pipeline=${1:?usage: scripts/kill-resume.sh PIPELINE.toml [FRACTION...]}
shift
fractions=("$@")
[ ${#fractions[@]} -gt 0 ] || fractions=(0.5)
npuc=${NPUC:-target/release/npuc}
[ -x "$npuc" ] || { echo "no npuc binary at '$npuc' (cargo build --release -p npuc-cli, or set NPUC)" >&2; exit 2; }
work=${WORK:-$(mktemp -d /tmp/npuc-kill-resume.XXXXXX)}
mkdir -p "$work"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# The bundle's files (not its cache or lock), sorted.
bundle_files() { (cd "$1" && find . -maxdepth 1 -type f ! -name '.npuc-build.lock' -printf '%f\n' | sort); }

ref="$work/reference"
t0=$(now)
"$npuc" build "$pipeline" -o "$ref" > "$work/reference.log" 2>&1
total=$(secs "$t0" "$(now)")
echo "reference build: ${total} s"

status=0
for f in "${fractions[@]}"; do
  out="$work/killed-$f"
  delay=$(awk -v t="$total" -v f="$f" 'BEGIN { printf "%.2f", t * f }')
  "$npuc" build "$pipeline" -o "$out" > "$work/killed-$f.log" 2>&1 &
  pid=$!
  sleep "$delay"
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid"
    wait "$pid" 2>/dev/null || true
    done_steps=$(grep -c '^\[' "$work/killed-$f.log" || true)
    echo "fraction $f: killed at ${delay} s after ${done_steps} finished step line(s); $(find "$out/.cache/tmp" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l) scratch dir(s) left"
  else
    wait "$pid" || true
    echo "fraction $f: the build finished before its kill at ${delay} s (not a kill test)" >&2
    status=1
  fi
  t1=$(now)
  "$npuc" build "$pipeline" -o "$out" > "$work/resumed-$f.log" 2>&1
  ran=$(grep -cE '^\[[0-9]+/[0-9]+\] +[^ ]+ +(ran|rebuilt)' "$work/resumed-$f.log" || true)
  echo "fraction $f: resumed in $(secs "$t1" "$(now)") s, ${ran} step(s) ran"
  if [ "$(bundle_files "$ref")" != "$(bundle_files "$out")" ]; then
    echo "fraction $f: the bundles hold different files" >&2
    diff <(bundle_files "$ref") <(bundle_files "$out") >&2 || true
    status=1
  fi
  for name in $(bundle_files "$ref"); do
    if ! cmp -s "$ref/$name" "$out/$name"; then
      echo "fraction $f: $name differs from the uninterrupted build" >&2
      status=1
    fi
  done
  t2=$(now)
  "$npuc" build "$pipeline" -o "$out" > "$work/rerun-$f.log" 2>&1
  if grep -q "nothing to do" "$work/rerun-$f.log"; then
    echo "fraction $f: third run: nothing to do in $(secs "$t2" "$(now)") s"
  else
    echo "fraction $f: the third run did work" >&2
    status=1
  fi
  [ $status -ne 0 ] || echo "fraction $f: $(bundle_files "$ref" | wc -l) files byte-identical to the uninterrupted build"
done
exit $status
