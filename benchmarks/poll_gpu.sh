#!/usr/bin/env bash
# Long GPU work in the background of the device machine, polled from successive device calls
# (a call lasts at most 10 minutes; the machine, and /root/keep, stay while calls follow at once).
#   bash benchmarks/poll_gpu.sh start SECONDS -- CMD...   start CMD (setsid), then poll
#   bash benchmarks/poll_gpu.sh poll SECONDS              poll a started CMD
# Polling returns when CMD has ended or SECONDS have passed, after packing /root/keep/out into
# $OUT: *.safetensors in parts of 15 MiB (`cat F.part* > F` joins them), everything else in
# results.tar.gz; *.gz files in parts too (the device tool brings back 8 files of 16 MiB at most).
set -uo pipefail
KEEP=/root/keep
mode=$1; secs=$2; shift 2
if [ "$mode" = start ]; then
  [ "${1:-}" = "--" ] && shift
  mkdir -p $KEEP/out
  rm -f $KEEP/run.rc
  setsid bash -c "$* > $KEEP/run.log 2>&1; echo \$? > $KEEP/run.rc" < /dev/null &
  sleep 2
fi
t0=$(date +%s)
while [ ! -f $KEEP/run.rc ] && [ $(( $(date +%s) - t0 )) -lt "$secs" ]; do sleep 5; done
out=${OUT:-/tmp/out}; mkdir -p "$out"
cp $KEEP/run.log $KEEP/out/run.log 2>/dev/null
(cd $KEEP/out && find . -name '*.safetensors' -o -name '*.gz' | while read -r f; do
   split -b 15M -d -a 1 "$f" "$out/$(echo "${f#./}" | tr / _).part"; done)
tar -czf "$out/results.tar.gz" -C $KEEP/out --exclude='*.safetensors' --exclude='*.gz' .
echo "== rc: $(cat $KEEP/run.rc 2>/dev/null || echo running)"
tr '\r' '\n' < $KEEP/run.log | grep -v '^\(train-draft\|Self-distilling\|Loading\)' | tail -60
tr '\r' '\n' < $KEEP/run.log | grep '^\(train-draft\|Self-distilling\)' | tail -2
