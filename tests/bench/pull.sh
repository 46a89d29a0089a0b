#!/usr/bin/env bash
# Puller benchmark: the same models from the same MinIO on loopback, in one
# run, pulled by the driver (CreateVolume of an s3:// cache volume, through
# the release binary and its socket) and by the peer clients `mc cp`,
# `s5cmd cp` and `aws s3 cp` (default and tuned). Also: raw disk write speed
# (dd) on the same filesystem, sha256 speed on this CPU, and the driver's
# peak RSS pulling a 10 GiB model.
#
# Benchmarks are not tests: this asserts nothing but correctness of the
# bytes each client wrote; it reports numbers. Run as root (drop_caches).
#
#   bash tests/bench/pull.sh
#
# Settings (environment):
#   BENCH_DIR        filesystem under test: state dirs and peer targets
#                    (default /var/tmp)
#   BENCH_MINIO_DIR  MinIO's data dir; tmpfs by default, so the source never
#                    touches the disk under test (default /dev/shm)
#   BENCH_REPS       repetitions of every measurement (default 3; the
#                    summary reports medians)
#   BENCH_DATASETS   default "real synth": the real model (tests/scripts/deps/
#                    model.sh) and a synthetic one
#   BENCH_SYNTH_GIB  synthetic model size, in 512 MiB files (default 2)
#   BENCH_MANY_FILES files of the "many" data set (1–65 KiB each, in 10
#                    directories; default 500); add "many" to BENCH_DATASETS
#   BENCH_BIG_GIB    driver-only RSS run, in 2 GiB files (default 10; 0 skips)
#   BENCH_BIG_CLIENTS who pulls the big model (default "driver"; add peers to
#                    compare at that size)
#   BENCH_CLIENTS    default "driver mc s5cmd aws aws-tuned"; "driver,FLAG,VALUE"
#                    is the driver with extra flags (e.g. driver,--pull-chunk-mib,8);
#                    "driver@BINARY" another build of it (e.g. an older commit's
#                    release binary), for before and after in one run
#   BENCH_DRIVER_ARGS extra flags for the driver (e.g. "--pull-connections 8")
#   BENCH_AWS_TUNED  s3 settings of aws-tuned (default
#                    "max_concurrent_requests=32 multipart_chunksize=32MB")
#   BENCH_DROP_CACHES 1 (default when writable): drop the page cache before
#                    every timed run
#   BENCH_NO_BUILD=1 use the release binaries as they are
#   BENCH_RESULTS    where results.tsv and summary.md go
#                    (default target/bench-pull)
# Every large file is removed at the end, also on error.
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"

BENCH_DIR="${BENCH_DIR:-/var/tmp}"
BENCH_MINIO_DIR="${BENCH_MINIO_DIR:-/dev/shm}"
REPS="${BENCH_REPS:-3}"
DATASETS="${BENCH_DATASETS:-real synth}"
SYNTH_GIB="${BENCH_SYNTH_GIB:-2}"
MANY_FILES="${BENCH_MANY_FILES:-500}"
BIG_GIB="${BENCH_BIG_GIB:-10}"
CLIENTS="${BENCH_CLIENTS:-driver mc s5cmd aws aws-tuned}"
BIG_CLIENTS="${BENCH_BIG_CLIENTS:-driver}"
DRIVER_ARGS="${BENCH_DRIVER_ARGS:-}"
AWS_TUNED="${BENCH_AWS_TUNED:-max_concurrent_requests=32 multipart_chunksize=32MB}"
RESULTS="${BENCH_RESULTS:-$ROOT/target/bench-pull}"
ACCESS_KEY="bench-user"
SECRET_KEY="bench-password-not-secret"
BUCKET="bench"

if [ -z "${BENCH_DROP_CACHES:-}" ]; then
  if sync && echo 1 >/proc/sys/vm/drop_caches 2>/dev/null; then
    BENCH_DROP_CACHES=1
  else
    BENCH_DROP_CACHES=0
  fi
fi

# ---- tools ----
if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then
  log "building the driver and the bench client (release)"
  (cd "$ROOT" && cargo build --release --quiet --bin modelcache-csi --example bench-pull-client)
fi
DRIVER="$ROOT/target/release/modelcache-csi"
CLIENT="$ROOT/target/release/examples/bench-pull-client"
MINIO="$(bash "$ROOT/tests/scripts/deps/minio.sh")"
MODEL="$(bash "$ROOT/tests/scripts/deps/model.sh" | tail -1)"
MC="$(bash "$ROOT/tests/bench/deps-mc.sh")"
S5CMD="$(bash "$ROOT/tests/bench/deps-s5cmd.sh")"
AWS="$(bash "$ROOT/tests/bench/deps-awscli.sh")"

# ---- scratch, and its cleanup ----
mkdir -p "$RESULTS"
WORK="$(mktemp -d "$BENCH_DIR/modelcache-pull-bench.XXXXXX")"
MDATA="$(mktemp -d "$BENCH_MINIO_DIR/modelcache-pull-bench-minio.XXXXXX")"
MINIO_PID=""
DRIVER_PID=""
cleanup() {
  local rc=$?
  [ -n "$DRIVER_PID" ] && kill "$DRIVER_PID" 2>/dev/null && wait "$DRIVER_PID" 2>/dev/null
  [ -n "$MINIO_PID" ] && kill "$MINIO_PID" 2>/dev/null && wait "$MINIO_PID" 2>/dev/null
  rm -rf "$WORK" "$MDATA"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

drop_caches() {
  sync
  if [ "$BENCH_DROP_CACHES" = 1 ]; then echo 3 >/proc/sys/vm/drop_caches; fi
}

TSV="$RESULTS/results.tsv"
printf 'rep\tdataset\tclient\tbytes\tseconds\tsync_seconds\tverify_seconds\tverify_cpu\tpeak_rss_kib\tcpu_user\tcpu_sys\tminio_cpu\tbusy_cpu\tload1\n' >"$TSV"
printf 'dataset\tbinary\tflags\tspilled_bytes\n' >"$RESULTS/spilled.tsv"
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$TSV"; }
load1() { cut -d' ' -f1 /proc/loadavg; }
# CPU seconds the whole machine has been busy (user, nice, system, irq,
# softirq): minus the bench's own, what other work took during a run.
busy() { awk -v t="$(getconf CLK_TCK)" '$1 == "cpu" {printf "%.2f", ($2 + $3 + $4 + $7 + $8) / t}' /proc/stat; }

# ---- the machine ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "kernel: $(uname -r)"
  echo "cpus: $(nproc) x $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)" \
    "(sha_ni: $(grep -qw sha_ni /proc/cpuinfo && echo yes || echo no))"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "bench dir: $BENCH_DIR on $(findmnt -no SOURCE,FSTYPE,OPTIONS -T "$BENCH_DIR" | head -1)"
  echo "minio dir: $BENCH_MINIO_DIR on $(findmnt -no SOURCE,FSTYPE -T "$BENCH_MINIO_DIR" | head -1)"
  echo "drop caches: $BENCH_DROP_CACHES"
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "driver: $("$DRIVER" --version) $DRIVER_ARGS"
  echo "mc: $("$MC" --version | head -1)"
  echo "s5cmd: $("$S5CMD" version)"
  echo "aws: $("$AWS" --version 2>&1)"
  echo "minio: $("$MINIO" --version | head -1)"
} | tee "$RESULTS/machine.txt" >&2

# ---- MinIO ----
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
ENDPOINT="http://127.0.0.1:$PORT"
MINIO_ROOT_USER="$ACCESS_KEY" MINIO_ROOT_PASSWORD="$SECRET_KEY" MINIO_BROWSER=off \
  MINIO_UPDATE=off "$MINIO" server --quiet --address "127.0.0.1:$PORT" "$MDATA/data" \
  >"$WORK/minio.log" 2>&1 &
MINIO_PID=$!
for _ in $(seq 300); do
  curl -fs -o /dev/null "$ENDPOINT/minio/health/ready" && break
  kill -0 "$MINIO_PID" 2>/dev/null || { cat "$WORK/minio.log" >&2; exit 1; }
  sleep 0.1
done
export MC_HOST_bench="http://$ACCESS_KEY:$SECRET_KEY@127.0.0.1:$PORT"
export MC_CONFIG_DIR="$WORK/mc-config"
"$MC" mb --quiet "bench/$BUCKET" >/dev/null
for _ in $(seq 100); do "$MC" ls "bench/$BUCKET" >/dev/null 2>&1 && break; sleep 0.1; done

# ---- data sets ----
# Each data set gets a manifest: "path<TAB>size<TAB>sha256", sorted.
manifest_of() {
  (cd "$1" && find . -type f -printf '%P\n' | LC_ALL=C sort | while read -r f; do
    printf '%s\t%s\t%s\n' "$f" "$(stat -c %s "$f")" "$(openssl dgst -sha256 -r "$f" | cut -d' ' -f1)"
  done)
}

# Pseudo-random bytes at several hundred MB/s: AES-CTR over zeros.
# openssl dies of SIGPIPE when head has enough: not a failure.
random_bytes() { # seed bytes
  { openssl enc -aes-128-ctr -pass "pass:$1" -nosalt -pbkdf2 -in /dev/zero 2>/dev/null || true; } |
    head -c "$2"
}

# synth_upload prefix files file_mib: N large "shards" plus a small config,
# generated on the tmpfs, hashed, uploaded, deleted.
synth_upload() {
  local prefix="$1" n="$2" mib="$3" stage="$MDATA/stage" i name
  mkdir -p "$stage"
  : >"$WORK/$prefix.manifest"
  printf '{"architectures":["Bench"],"shards":%d}\n' "$n" >"$stage/config.json"
  printf 'config.json\t%s\t%s\n' "$(stat -c %s "$stage/config.json")" \
    "$(openssl dgst -sha256 -r "$stage/config.json" | cut -d' ' -f1)" >>"$WORK/$prefix.manifest"
  "$MC" cp --quiet "$stage/config.json" "bench/$BUCKET/$prefix/config.json" >/dev/null
  for i in $(seq 1 "$n"); do
    name="$(printf 'model-%05d-of-%05d.safetensors' "$i" "$n")"
    random_bytes "$prefix-$i" $((mib << 20)) >"$stage/$name"
    printf '%s\t%s\t%s\n' "$name" $((mib << 20)) \
      "$(openssl dgst -sha256 -r "$stage/$name" | cut -d' ' -f1)" >>"$WORK/$prefix.manifest"
    "$MC" cp --quiet "$stage/$name" "bench/$BUCKET/$prefix/$name" >/dev/null
    rm -f "$stage/$name"
  done
  rm -rf "$stage"
  LC_ALL=C sort -o "$WORK/$prefix.manifest" "$WORK/$prefix.manifest"
}

for ds in $DATASETS; do
  case "$ds" in
    real)
      log "uploading the real model ($MODEL)"
      "$MC" cp --quiet --recursive "$MODEL/" "bench/$BUCKET/real/" >/dev/null
      manifest_of "$MODEL" >"$WORK/real.manifest"
      ;;
    synth)
      log "generating and uploading a ${SYNTH_GIB} GiB synthetic model ($((SYNTH_GIB * 2)) x 512 MiB)"
      synth_upload synth $((SYNTH_GIB * 2)) 512
      ;;
    many)
      log "generating and uploading $MANY_FILES small files"
      stage="$MDATA/stage-many"
      mkdir -p "$stage"
      for i in $(seq 1 "$MANY_FILES"); do
        d="$stage/part-$((i % 10))"
        mkdir -p "$d"
        random_bytes "many-$i" $(((i * 7919) % 65536 + 1024)) >"$d/file-$i.bin"
      done
      manifest_of "$stage" >"$WORK/many.manifest"
      "$MC" cp --quiet --recursive "$stage/" "bench/$BUCKET/many/" >/dev/null
      rm -rf "$stage"
      ;;
    *) echo "unknown data set $ds" >&2; exit 2 ;;
  esac
done
# %.0f: mawk's %d stops at 2^31.
bytes_of() { awk -F'\t' '{s+=$2} END {printf "%.0f\n", s}' "$WORK/$1.manifest"; }

# ---- the clients ----
# Each run_* pulls data set $1 into a fresh place and sets SECS, RSS_KIB and
# DEST.
export AWS_ACCESS_KEY_ID="$ACCESS_KEY" AWS_SECRET_ACCESS_KEY="$SECRET_KEY" AWS_REGION=us-east-1
export AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.3f", b - a}'; }

# CPU seconds (user+system) a process has used so far.
CLK_TCK="$(getconf CLK_TCK)"
cpu_of() { awk -v t="$CLK_TCK" '{printf "%.2f %.2f", $14 / t, $15 / t}' "/proc/$1/stat"; }

# Runs "$@", timed, with its peak RSS and CPU time.
timed() {
  /usr/bin/time -f '%e %M %U %S' -o "$WORK/time.out" "$@" >"$WORK/client.out" 2>&1 || {
    cat "$WORK/client.out" "$WORK/time.out" >&2
    return 1
  }
  read -r SECS RSS_KIB CPU_USER CPU_SYS <"$WORK/time.out"
}

N=0
run_driver() { # data set, extra flags, binary (default: this tree's)
  local ds="$1" state="$WORK/driver-state" sock="$WORK/csi.sock" out src seal
  N=$((N + 1))
  rm -rf "$state" "$sock"
  mkdir -p "$state"
  # shellcheck disable=SC2086 # lists of flags
  RUST_LOG=info NO_COLOR=1 "${3:-$DRIVER}" --endpoint "unix://$sock" --node-id bench \
    --state-dir "$state" --backends local $DRIVER_ARGS $2 >"$WORK/driver.log" 2>&1 &
  DRIVER_PID=$!
  # The client waits for the socket, then times CreateVolume alone.
  out="$(BENCH_S3_ACCESS_KEY="$ACCESS_KEY" BENCH_S3_SECRET_KEY="$SECRET_KEY" "$CLIENT" create \
    --socket "$sock" --name "pvc-bench-$N" --source "s3://$BUCKET/$ds" \
    --s3-endpoint "$ENDPOINT")" || { cat "$WORK/driver.log" >&2; return 1; }
  # The process lives on: its high-water mark is this pull's peak.
  RSS_KIB="$(awk '/^VmHWM:/ {print $2}' "/proc/$DRIVER_PID/status")"
  read -r CPU_USER CPU_SYS <<<"$(cpu_of "$DRIVER_PID")"
  kill "$DRIVER_PID"
  wait "$DRIVER_PID" || true
  DRIVER_PID=""
  # Bytes that ran ahead of a full reorder window and were hashed from disk.
  printf '%s\t%s\t%s\t%s\n' "$ds" "${3:-driver}" "$2" \
    "$(grep -o 'spilled_bytes=[0-9]*' "$WORK/driver.log" | cut -d= -f2 | tail -1 || true)" \
    >>"$RESULTS/spilled.tsv"
  SECS="$(jq -r .seconds <<<"$out")"
  src="$(jq -r .source <<<"$out")"
  seal="$(find "$state" -path "*/$src/seal.json")"
  DEST="$(dirname "$seal")/data"
  # The seal's hashes are the driver's own streaming sha256.
  jq -r '.files[] | [.path, .size, .sha256] | @tsv' "$seal" | LC_ALL=C sort >"$WORK/got.manifest"
}

run_mc() {
  DEST="$WORK/dest"
  timed "$MC" cp --quiet --recursive "bench/$BUCKET/$1/" "$DEST/"
}

run_s5cmd() {
  DEST="$WORK/dest"
  timed "$S5CMD" --endpoint-url "$ENDPOINT" cp "s3://$BUCKET/$1/*" "$DEST/"
}

aws_config() { # name key=value...
  local f="$WORK/aws-$1.config" kv
  shift
  printf '[default]\nregion = us-east-1\n' >"$f"
  [ $# -gt 0 ] && printf 's3 =\n' >>"$f"
  for kv in "$@"; do printf '  %s = %s\n' "${kv%%=*}" "${kv#*=}" >>"$f"; done
  echo "$f"
}
AWS_DEFAULT_CONFIG="$(aws_config default)"
# shellcheck disable=SC2086 # a list of key=value
AWS_TUNED_CONFIG="$(aws_config tuned $AWS_TUNED)"

run_aws() { # data set, config file
  DEST="$WORK/dest"
  AWS_CONFIG_FILE="$2" timed "$AWS" s3 cp --recursive --only-show-errors \
    --endpoint-url "$ENDPOINT" "s3://$BUCKET/$1/" "$DEST/"
}

# Peers write through the page cache and return; `sync -f` after them is
# timed separately (the driver's time already includes its fsyncs), and so
# is `sha256sum` of every file they wrote, with its CPU: the driver's time
# includes verifying every byte, so "durable and verified" is the same work.
verify() { # dir
  /usr/bin/time -f '%U %S' -o "$WORK/verify.time" bash -c \
    'cd "$1" && find . -type f -print0 | xargs -0 sha256sum > /dev/null' _ "$1"
  awk '{printf "%.2f", $1 + $2}' "$WORK/verify.time"
}

pull() { # rep data set client
  local rep="$1" ds="$2" client="$3" sync_secs=0 verify_secs=0 verify_cpu=0 t0 load minio0 minio_cpu busy0 busy_cpu flags bin
  rm -rf "$WORK/dest" "$WORK/driver-state"
  drop_caches
  load="$(load1)"
  minio0="$(cpu_of "$MINIO_PID")"
  busy0="$(busy)"
  case "$client" in
    driver | driver,* | driver@*)
      flags="${client#driver}" bin=""
      if [[ "$flags" == @* ]]; then
        bin="${flags#@}" && bin="${bin%%,*}" && flags="${flags#@"$bin"}"
      fi
      run_driver "$ds" "$(tr ',' ' ' <<<"$flags")" "$bin"
      ;;
    mc) run_mc "$ds" ;;
    s5cmd) run_s5cmd "$ds" ;;
    aws) run_aws "$ds" "$AWS_DEFAULT_CONFIG" ;;
    aws-tuned) run_aws "$ds" "$AWS_TUNED_CONFIG" ;;
    *) echo "unknown client $client" >&2; return 2 ;;
  esac
  busy_cpu="$(awk -v a="$busy0" -v b="$(busy)" 'BEGIN {printf "%.2f", b - a}')"
  minio_cpu="$(cpu_of "$MINIO_PID" | awk -v a="$minio0" '{split(a, b, " "); printf "%.2f", $1 + $2 - b[1] - b[2]}')"
  if [[ "$client" != driver* ]]; then
    t0="$(now)"
    sync -f "$DEST"
    sync_secs="$(since "$t0")"
    t0="$(now)"
    verify_cpu="$(verify "$DEST")"
    verify_secs="$(since "$t0")"
    manifest_of "$DEST" >"$WORK/got.manifest"
  fi
  cmp -s "$WORK/got.manifest" "$WORK/$ds.manifest" || {
    echo "$client: what it pulled of $ds does not match the manifest" >&2
    diff "$WORK/$ds.manifest" "$WORK/got.manifest" >&2 || true
    return 1
  }
  record "$rep" "$ds" "$client" "$(bytes_of "$ds")" "$SECS" "$sync_secs" "$verify_secs" "$verify_cpu" "$RSS_KIB" \
    "$CPU_USER" "$CPU_SYS" "$minio_cpu" "$busy_cpu" "$load"
  log "rep $rep $ds $client: ${SECS}s (+${sync_secs}s sync, +${verify_secs}s sha256sum), peak RSS ${RSS_KIB} KiB," \
    "CPU ${CPU_USER}u+${CPU_SYS}s, MinIO CPU ${minio_cpu}s, machine busy ${busy_cpu}s, load $load"
  rm -rf "$WORK/dest" "$WORK/driver-state"
}

# ---- raw disk and hashing ----
DISK_TSV="$RESULTS/disk.tsv"
printf 'rep\tmode\tbytes\tseconds\tload1\n' >"$DISK_TSV"
# direct: O_DIRECT, the device's speed. fsync: through the page cache, one
# fsync at the end (dd conv=fsync). fsync-x4: four such writers at once, each
# a quarter of the bytes, as the driver writes four files at once.
disk() { # rep mode bytes
  local count=$(($3 / (16 << 20))) flag t0 secs load writers=1 i pids=()
  case "$2" in *direct) flag="oflag=direct" ;; *fsync*) flag="conv=fsync" ;; esac
  case "$2" in *x4) writers=4 ;; esac
  count=$((count / writers))
  drop_caches
  load="$(load1)"
  t0="$(now)"
  for i in $(seq 1 "$writers"); do
    dd if=/dev/zero of="$WORK/dd.$i" bs=16M count="$count" "$flag" status=none &
    pids+=($!)
  done
  wait "${pids[@]}"
  secs="$(since "$t0")"
  rm -f "$WORK"/dd.*
  count=$((count * writers))
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$((count * (16 << 20)))" "$secs" "$load" >>"$DISK_TSV"
  log "rep $1 dd $2 $((count * 16)) MiB: ${secs}s"
}

SHA_TSV="$RESULTS/sha256.tsv"
printf 'rep\ttool\tmb_per_s\n' >"$SHA_TSV"
hashing() { # rep
  local f="$MDATA/hash.bin" t0 secs out
  # The engine's hasher: the sha2 crate as the driver builds it.
  out="$("$CLIENT" sha256 --mib 1024 --passes 1)"
  printf '%s\tsha2 crate (per wall s)\t%.0f\n' "$1" "$(jq .sha256_mb_per_s <<<"$out")" >>"$SHA_TSV"
  printf '%s\tsha2 crate (per CPU s)\t%.0f\n' "$1" "$(jq .sha256_mb_per_cpu_s <<<"$out")" >>"$SHA_TSV"
  # openssl speed divides by user CPU time.
  printf '%s\topenssl speed (per CPU s)\t%.0f\n' "$1" "$(openssl speed -evp sha256 -bytes 1048576 \
    -seconds 2 2>/dev/null | awk '$1 == "sha256" {sub(/k$/, "", $2); print $2 / 1000}')" >>"$SHA_TSV"
  random_bytes hash $((1 << 30)) >"$f"
  t0="$(now)"
  sha256sum "$f" >/dev/null
  secs="$(since "$t0")"
  printf '%s\tsha256sum (per wall s)\t%.0f\n' "$1" "$(awk -v s="$secs" 'BEGIN {print 1073.741824 / s}')" >>"$SHA_TSV"
  rm -f "$f"
}

# ---- the runs: every client and data set once per repetition ----
disk_bytes=$((SYNTH_GIB << 30))
for rep in $(seq 1 "$REPS"); do
  disk "$rep" direct "$disk_bytes"
  disk "$rep" fsync "$disk_bytes"
  disk "$rep" fsync-x4 "$disk_bytes"
  hashing "$rep"
  # The order rotates by repetition: the first pull after a data set's
  # setup, or after the previous pull's output was deleted (ext4 mounted
  # with discard trims it meanwhile), ran measurably slower.
  read -r -a order <<<"$CLIENTS"
  shift_by=$(((rep - 1) % ${#order[@]}))
  order=("${order[@]:shift_by}" "${order[@]:0:shift_by}")
  for ds in $DATASETS; do
    for client in "${order[@]}"; do
      pull "$rep" "$ds" "$client"
    done
  done
done

# ---- a big model (by default the driver alone): peak RSS ----
if [ "$BIG_GIB" -gt 0 ]; then
  "$MC" rm --quiet --recursive --force "bench/$BUCKET/synth/" >/dev/null 2>&1 || true
  log "generating and uploading a ${BIG_GIB} GiB synthetic model ($((BIG_GIB / 2)) x 2 GiB)"
  synth_upload big $((BIG_GIB / 2)) 2048
  for rep in $(seq 1 "$REPS"); do
    for client in $BIG_CLIENTS; do
      pull "$rep" big "$client"
    done
  done
  for rep in $(seq 1 "$REPS"); do
    disk "$rep" big-direct $((BIG_GIB << 30))
  done
fi

# ---- summary ----
python3 - "$TSV" "$DISK_TSV" "$SHA_TSV" "$RESULTS/machine.txt" "$(nproc)" >"$RESULTS/summary.md" <<'PY'
import csv, statistics, sys
runs = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
disk = list(csv.DictReader(open(sys.argv[2]), delimiter="\t"))
sha = list(csv.DictReader(open(sys.argv[3]), delimiter="\t"))
cpus = int(sys.argv[5])
med = statistics.median
print("## Machine\n")
print("```")
print(open(sys.argv[4]).read().rstrip())
print("```\n")
print("## Raw disk write (dd bs=16M from /dev/zero, page cache dropped first)\n")
print("| mode | size MiB | MB/s (median) | runs MB/s |")
print("|---|---|---|---|")
dd = {}
for mode in dict.fromkeys(d["mode"] for d in disk):
    ds = [d for d in disk if d["mode"] == mode]
    rates = [int(d["bytes"]) / float(d["seconds"]) / 1e6 for d in ds]
    dd[mode] = med(rates)
    print(f"| {mode} | {int(ds[0]['bytes']) >> 20} | {dd[mode]:.0f} | {', '.join(f'{r:.0f}' for r in rates)} |")
print("\n## sha256 on this CPU (1 GiB in memory), median\n")
print("| tool | MB/s |")
print("|---|---|")
for tool in dict.fromkeys(s["tool"] for s in sha):
    print(f"| {tool} | {med(float(s['mb_per_s']) for s in sha if s['tool'] == tool):.0f} |")
print("\n## Pulls, medians\n")
print("MB/s = bytes / wall seconds / 1e6. *Durable* adds the `sync -f` run after a peer;")
print("*durable+verified* adds `sha256sum` of every file too: the same work as the driver,")
print("whose time already includes its fsyncs and its sha256 of every byte, and which")
print("returns only once the model is sealed. CPU = the client's user+system seconds per GB;")
print("*CPU s/GB verified* adds sha256sum's.")
print(f"MinIO = the server's. CPU ceiling = what {cpus} idle cores could move at that cost.")
print("Others = CPU the rest of the machine (other users' work) took during the run, as a")
print(f"share of the {cpus} cores: the contention each number was measured under.\n")
for ds in dict.fromkeys(r["dataset"] for r in runs):
    rows = [r for r in runs if r["dataset"] == ds]
    size = int(rows[0]["bytes"])
    print(f"### {ds}: {size / 1e6:.1f} MB\n")
    print("| client | s | MB/s | MB/s durable | MB/s durable+verified | peak RSS MiB | CPU s/GB "
          "| CPU s/GB verified | MinIO CPU s/GB | CPU ceiling MB/s | runs s | others % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    stat = {}
    for client in dict.fromkeys(r["client"] for r in rows):
        rs = [r for r in rows if r["client"] == client]
        s = med(float(r["seconds"]) for r in rs)
        sd = med(float(r["seconds"]) + float(r["sync_seconds"]) for r in rs)
        sv = med(float(r["seconds"]) + float(r["sync_seconds"]) + float(r["verify_seconds"]) for r in rs)
        vcpu = med(float(r["verify_cpu"]) for r in rs)
        rss = med(int(r["peak_rss_kib"]) for r in rs) / 1024
        cpu = med(float(r["cpu_user"]) + float(r["cpu_sys"]) for r in rs)
        mcpu = med(float(r["minio_cpu"]) for r in rs)
        ceiling = size / ((cpu + mcpu) / cpus) / 1e6 if cpu + mcpu > 0 else float("inf")
        stat[client] = (size / s / 1e6, size / sd / 1e6, size / sv / 1e6)
        each = ", ".join("%.2f" % float(r["seconds"]) for r in rs)
        others = lambda r: max(0.0, float(r["busy_cpu"]) - float(r["cpu_user"])
                               - float(r["cpu_sys"]) - float(r["minio_cpu"]))
        loads = ", ".join("%.0f" % (100 * others(r) / cpus / float(r["seconds"])) for r in rs)
        print(f"| {client} | {s:.2f} | {stat[client][0]:.0f} | {stat[client][1]:.0f} "
              f"| {stat[client][2]:.0f} | {rss:.0f} "
              f"| {cpu / size * 1e9:.2f} | {(cpu + vcpu) / size * 1e9:.2f} | {mcpu / size * 1e9:.2f} "
              f"| {ceiling:.0f} | {each} | {loads} |")
    if "driver" in stat:
        d = stat["driver"][0]
        peers = {c: v for c, v in stat.items() if not c.startswith("driver")}
        for c, (v, _, _) in stat.items():
            if c.startswith("driver@"):
                print(f"\ndriver/{c} = {d / v:.2f}x (this tree against another build).")
        if peers:
            print("\n| driver vs | ratio, peer as returned | ratio, peer durable "
                  "| ratio, peer durable+verified |")
            print("|---|---|---|---|")
            for c, (v, vd, vv) in peers.items():
                print(f"| {c} | {d / v:.2f}x | {d / vd:.2f}x | {d / vv:.2f}x |")
            best = max(peers, key=lambda c: peers[c][0])
            bestd = max(peers, key=lambda c: peers[c][1])
            bestv = max(peers, key=lambda c: peers[c][2])
            print(f"\nFastest peer as returned: {best}, driver/{best} = {d / peers[best][0]:.2f}x; "
                  f"durable: {bestd}, driver/{bestd} = {d / peers[bestd][1]:.2f}x; "
                  f"durable+verified: {bestv}, driver/{bestv} = {d / peers[bestv][2]:.2f}x.")
        for mode, v in dd.items():
            if mode.startswith("big") == (ds == "big"):
                print(f"Driver = {100 * d / v:.0f}% of dd {mode} ({v:.0f} MB/s).")
    print()
PY
cat "$RESULTS/summary.md"
log "results in $RESULTS"
