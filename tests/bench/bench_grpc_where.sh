#!/bin/bash
# gRPC in the gateway process (same loop as uvicorn) vs in a gateway process of its own,
# under mixed load: HTTP binary C=32 and gRPC C=32 at once, same server, same run
set -u
OUT=$(mktemp -d /tmp/zsgrpcwhereXXXX)
cd "$(dirname "$0")/../.."
Z="${PYTHON:-python} bin/zeroserve"
RT=$(mktemp -d /tmp/zsbrtXXXX)
HP=18481; GP=18482; HP2=18483; GP2=18484
$Z serve --runtime-dir $RT --http-port $HP --grpc-port $GP --log-level warning > $RT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:$HP/v2/health/ready >/dev/null && break; sleep 1; done
$Z gateway --runtime-dir $RT --http-port $HP2 --grpc-port $GP2 --log-level warning > $RT/gw2.log 2>&1 &
GW2=$!
for i in $(seq 1 60); do curl -sf http://127.0.0.1:$HP2/v2/health/ready >/dev/null && break; sleep 1; done
B="$Z bench -m mlp --runtime-dir $RT --concurrency 32 --warmup-s 1 --duration-s 6 --quiet"
for round in 1 2; do
  for where in same own; do
    if [ $where = same ]; then G=$GP; else G=$GP2; fi
    $B --url http://127.0.0.1:$HP --transport http-binary --json $OUT/${where}_http_$round.json > /dev/null &
    P1=$!
    $B --url http://127.0.0.1:$HP --grpc-url 127.0.0.1:$G --transport grpc --json $OUT/${where}_grpc_$round.json > /dev/null
    wait $P1
    python3 -c "
import json,sys
h=json.load(open('$OUT/${where}_http_$round.json'))['levels'][0]; g=json.load(open('$OUT/${where}_grpc_$round.json'))['levels'][0]
print('$where round $round: http-binary %.0f req/s p50 %.2f p99 %.2f | grpc %.0f req/s p50 %.2f p99 %.2f | total %.0f' % (h['throughput_rps'],h['p50_ms'],h['p99_ms'],g['throughput_rps'],g['p50_ms'],g['p99_ms'],h['throughput_rps']+g['throughput_rps']))"
  done
done
kill -TERM $GW2; wait $GW2
kill -TERM $SP; wait $SP
rm -rf $RT
rm -rf $OUT
