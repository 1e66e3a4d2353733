#!/usr/bin/env bash
# Mutation testing (issue #28) with mutmut 3: mutate hostagent/domain, services, store, the placement model (learn/)
# and the web handlers, run for each mutant only the fast tests that cover it, and print the score per package.
# See docs/testing.md.
#
#   bash scripts/mutation.sh [PACKAGE] [--sample N] [--cap DURATION] [--jobs N] [--fresh]
#
#   PACKAGE      domain | services | store | learn | web | all (default all).
#   --sample N   test one mutant in N, the same ones every time (default: 50 for all, under an hour on 2 CPUs;
#                1, every mutant, for one package; see docs/testing.md).
#   --cap D      stop after D (600, 600s, 25m, 1h; default 60m; 0 = no cap). Results so far are kept in mutants/,
#                and a run tests only mutants without a result: the next run goes on where this one stopped.
#   --jobs N     mutants tested at once (default: the CPU count).
#   --fresh      forget earlier results (rm -rf mutants/) and start again.
#
# What is mutated and which tests run is [tool.mutmut] in pyproject.toml; mutmut works on a copy in ./mutants/
# (its results live there too, and an edited function loses its results). The score table and the surviving
# mutants (artifacts/mutation/survivors-<pkg>.txt) come from scripts/mutation_score.py; the run's log is
# artifacts/mutation/run-<pkg>.log; `.venv/bin/mutmut show NAME` shows one mutant.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

pkg=all cap=60m jobs=$(nproc) fresh=0 sample=
while [ $# -gt 0 ]; do
  case "$1" in
    domain|services|store|learn|web|all) pkg=$1 ;;
    --cap) cap=${2:?--cap needs a duration}; shift ;;
    --cap=*) cap=${1#--cap=} ;;
    --jobs) jobs=${2:?--jobs needs a number}; shift ;;
    --jobs=*) jobs=${1#--jobs=} ;;
    --sample) sample=${2:?--sample needs a number}; shift ;;
    --sample=*) sample=${1#--sample=} ;;
    --fresh) fresh=1 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "mutation: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

# What it needs: the test environment (scripts/deps.sh, as scripts/test.sh does) and the `mutation` extra.
if ! .venv/bin/python -c 'import pytest, pytest_asyncio, hypothesis, hostagent' 2>/dev/null; then
  bash scripts/deps.sh test
fi
if ! .venv/bin/python -c 'import sys, mutmut; sys.exit(tuple(map(int, mutmut.__version__.split(".")[:2])) < (3, 8))' \
    2>/dev/null; then
  echo "mutation: pip install -e '.[mutation]'"
  .venv/bin/python -m pip install -q -e '.[mutation]'
fi

out=artifacts/mutation
mkdir -p "$out"
[ "$fresh" = 1 ] && rm -rf mutants
# The default: one package, all of its mutants; every package, one mutant in 50 (under an hour on 2 CPUs).
[ -n "$sample" ] || { [ "$pkg" = all ] && sample=50 || sample=1; }
case $cap in
  *h) cap_s=$(( ${cap%h} * 3600 )) ;; *m) cap_s=$(( ${cap%m} * 60 )) ;; *s) cap_s=${cap%s} ;; *) cap_s=$cap ;;
esac
start=$(date +%s)

# Make the mutants first (mutmut run's own first step, alone), so the mutants to test can be named: those of one
# package, one in N with --sample, and only those without a result (a capped run's next run goes on, not over).
if [ "$pkg" = all ]; then pkgs=(domain services store learn web); else pkgs=("$pkg"); fi
args=()
if .venv/bin/python scripts/mutation_score.py generate --jobs "$jobs"; then
  if [ "$pkg" != all ] || [ "$sample" != 1 ]; then
    mapfile -t args < <(.venv/bin/python scripts/mutation_score.py select "${pkgs[@]}" --sample "$sample")
    if [ ${#args[@]} -eq 0 ]; then
      echo "mutation: every mutant of ${pkgs[*]} (one in $sample) has a result (--fresh to test again)"
    fi
  fi
elif [ "$pkg" != all ]; then
  args=("hostagent.$pkg.*")  # this mutmut cannot be asked for its mutants ahead: the whole package, afresh
else
  echo "mutation: no sample with this mutmut: every mutant of every package, as far as the cap allows"
  sample=1
fi

tested() { .venv/bin/python scripts/mutation_score.py tested; }
before=$(tested)
log="$out/run-$pkg.log"
rc=0
if { [ "$pkg" = all ] && [ "$sample" = 1 ]; } || [ ${#args[@]} -gt 0 ]; then
  what="hostagent/{${pkgs[*]}}"; what=${what// /,}
  [ ${#args[@]} -gt 0 ] && what="$what, ${#args[@]} name(s)/glob(s) (one mutant in $sample, untested ones)"
  echo "mutation: mutmut run over $what; cap ${cap}, ${jobs} at once; log: $log"
  for attempt in 1 2; do
    # SIGINT to mutmut alone (--foreground): it stops its workers and keeps every result it has; -k: then SIGKILL.
    timeout_=()
    if [ "$cap_s" != 0 ]; then
      left=$(( cap_s - ($(date +%s) - start) )); [ "$left" -gt 0 ] || left=1
      timeout_=(timeout --foreground -s INT -k 120 "$left")
    fi
    set +e
    # mutmut redraws a spinner line with \r: show each phase once, and the tally (tested/total, killed...) every
    # ~30 s; the verdict of each mutant named on the command line is only in the log.
    "${timeout_[@]}" .venv/bin/mutmut run --max-children "$jobs" "${args[@]}" 2>&1 | tee "$log" | tr '\r' '\n' \
      | LC_ALL=C awk '/^\342\240/ { t = substr($0, 5); if (index(t, "🎉")) { if (++n % 300 != 1) next }
                                     else if (t == last) next; last = t }
                       NF == 2 && $2 ~ /^hostagent\./ { next }
                       NF { print; fflush() }'
    rc=${PIPESTATUS[0]}
    set -e
    # Before testing mutants mutmut runs the tests on the unmutated code, traced ("stats", once) and then those of
    # the mutants to test (the "clean run"); a test that fails there now and then (timing under load, the order
    # mutmut gives the tests in) stops the whole run: once more. (Seen for both: 2026-11-25, 2026-11-27.)
    if [ "$rc" = 1 ] && [ "$attempt" = 1 ] && grep -Eq "Failed to run clean test|failed to collect stats" "$log"; then
      echo "mutation: the tests failed on the unmutated code (a flaky test?); trying once more"
      continue
    fi
    break
  done
  wall=$(( $(date +%s) - start ))
  after=$(tested)
  n=$(( after - before ))
  rate=$(awk -v n="$n" -v w="$wall" 'BEGIN { printf "%.2f", (w > 0 ? n / w : 0) }')
  case $rc in
    0) ;;
    124|130) echo "mutation: stopped by the cap ($cap); results so far are kept, run again to go on" ;;
    *) echo "mutation: mutmut exited $rc (see $log)" ;;
  esac
  echo "mutation: $n mutants tested in ${wall}s wall (${rate} mutants/s, making mutants, stats and clean run included)"
fi

echo
.venv/bin/python scripts/mutation_score.py score $([ "$pkg" = all ] || echo "$pkg")
case $rc in 0|124|130) exit 0 ;; *) exit "$rc" ;; esac
