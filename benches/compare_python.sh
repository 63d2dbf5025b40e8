#!/usr/bin/env bash
# policyd against openpi's Python server and the transport floor, on every demo profile, in one
# run per profile (the three taken in turn, so machine noise hits them alike):
#   - policyd (release build) serving configs/<profile>.toml on the CPU engine;
#   - openpi's own server code (PyPI `openpi-server`) wrapping onnxruntime over the same ONNX
#     model and transforms (benches/python_server.py);
#   - the transport floor (`policyd bench --floor`).
# Two loads each: one connection closed loop, and 4 connections at 50 Hz open loop.
# Writes JSON reports, SVG plots and table.md to $OUT (default target/bench-compare).
#
#   benches/compare_python.sh            # DURATION=10 seconds per target and load
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/bench-compare}
DURATION=${DURATION:-10}
VENV=${VENV:-target/bench-venv}
PROFILES=${PROFILES:-tiny libero droid aloha}
mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q openpi-server onnxruntime numpy
fi
cargo build --release -q -p policyd -p policyd-bench
BIN=target/release/policyd

wait_port() {
    for _ in $(seq 1 150); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.2
    done
    echo "nothing listens on port $1" >&2
    return 1
}

for profile in $PROFILES; do
    "$BIN" --config "configs/$profile.toml" --port 8011 --log-format plain 2>"$OUT/$profile-policyd.log" &
    P=$!
    "$VENV/bin/python" benches/python_server.py --config "configs/$profile.toml" --port 8012 2>"$OUT/$profile-python.log" &
    Q=$!
    trap 'kill $P $Q 2>/dev/null || true' EXIT
    wait_port 8011
    wait_port 8012
    common=(ws://127.0.0.1:8011 --profile "$profile" --name policyd
            --compare ws://127.0.0.1:8012 --compare-name python --floor --duration "$DURATION")
    echo "== $profile: 1 connection, closed loop" >&2
    "$BIN" bench "${common[@]}" --json --plot "$OUT/$profile-closed.svg" >"$OUT/$profile-closed.json"
    echo "== $profile: 4 connections at 50 Hz" >&2
    "$BIN" bench "${common[@]}" -c 4 --rate 50 --json --plot "$OUT/$profile-4x50hz.svg" >"$OUT/$profile-4x50hz.json"
    kill $P $Q 2>/dev/null || true
    wait $P $Q 2>/dev/null || true
    trap - EXIT
done
python3 benches/comparison_table.py "$OUT"/*-closed.json "$OUT"/*-4x50hz.json | tee "$OUT/table.md"
