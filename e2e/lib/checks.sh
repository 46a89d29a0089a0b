# shellcheck shell=bash disable=SC2034
# What both e2e suites use (e2e/run: the driver as host processes on one node;
# e2e/run-deployed: deploy/csi-driver installed as pods on a multi-node
# cluster): the PASS/FAIL summary, PVCs and busybox pods, the reader pod's
# checks, and MinIO with its audit log. Sourced after common.sh and load_env;
# the caller sets RESULTS, SUMMARY, FLOW, passed and failed.
# --- checks ------------------------------------------------------------------------------

# check WHAT CMD...: one line in the summary, PASS or FAIL.
check() {
    local what=$1
    shift
    if "$@" >"$RESULTS/last-check.out" 2>&1; then
        passed=$((passed + 1))
        printf 'PASS  %-12s %s\n' "$FLOW" "$what" | tee -a "$SUMMARY" >&2
        return 0
    fi
    failed=$((failed + 1))
    printf 'FAIL  %-12s %s\n' "$FLOW" "$what" | tee -a "$SUMMARY" >&2
    sed 's/^/        /' "$RESULTS/last-check.out" | tail -n 40 | tee -a "$SUMMARY" >&2
    return 1
}

note() { printf '      %-12s %s\n' "$FLOW" "$*" | tee -a "$SUMMARY" >&2; }

same_file() { diff -u "$1" "$2"; }
not() { ! "$@"; }
contains() { grep -qF -- "$2" "$1" || { echo "'$2' not in $1:"; cat "$1"; return 1; }; }

# --- cluster objects -----------------------------------------------------------------------

fresh_ns() {
    kctl delete namespace "$1" --wait=true --timeout=120s >/dev/null 2>&1 || true
    kctl create namespace "$1" >/dev/null
}

# pvc NS NAME CLASS ACCESS [ANNOTATIONS_YAML] [DATASOURCE]
pvc() {
    local ns=$1 name=$2 sc=$3 access=$4 ann=${5:-} ds=${6:-}
    kctl apply -n "$ns" -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $name
  annotations: {${ann}}
spec:
  storageClassName: $sc
  accessModes: [$access]
  resources: {requests: {storage: 512Mi}}
$( [[ -n $ds ]] && echo "  dataSource: {kind: PersistentVolumeClaim, name: $ds}" )
EOF
}

# busybox_pod NS NAME SCRIPT READONLY VOLUME: busybox running SCRIPT with
# VOLUME (the YAML of one pod volume named model, indented 6) at /model; on
# node POD_NODE when that is set (a nodeSelector, so the scheduler still
# picks it and sets a WaitForFirstConsumer claim's selected node).
busybox_pod() {
    local ns=$1 name=$2 script=$3 ro=$4 volume=$5
    kctl apply -n "$ns" -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $name
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
$( [[ -n ${POD_NODE:-} ]] && echo "  nodeSelector: {kubernetes.io/hostname: $POD_NODE}" )
  containers:
    - name: c
      image: $BUSYBOX_IMAGE
      imagePullPolicy: Never
      command: [sh, -c]
      args:
        - |
$(sed 's/^/          /' <<<"$script")
      volumeMounts: [{name: model, mountPath: /model, readOnly: $ro}]
  volumes:
    - name: model
$volume
EOF
}

# pod NS NAME CLAIM SCRIPT [READONLY]: busybox_pod with the claim at /model.
pod() {
    local ro=${5:-false}
    busybox_pod "$1" "$2" "$4" "$ro" "      persistentVolumeClaim: {claimName: $3, readOnly: $ro}"
}

# inline_pod NS NAME SOURCE SCRIPT [ATTRIBUTES]: busybox_pod with a CSI
# inline volume of SOURCE at /model, read-only (more volumeAttributes, as
# YAML map entries, in ATTRIBUTES); its nodePublishSecretRef is the Secret
# INLINE_SECRET names, when set.
inline_pod() {
    local src=$3 attrs=${5:-}
    busybox_pod "$1" "$2" "$4" true "      csi:
        driver: $DRIVER_NAME
        readOnly: true
        volumeAttributes: {source: \"$src\"${attrs:+, $attrs}}$( [[ -n ${INLINE_SECRET:-} ]] && printf '\n        nodePublishSecretRef: {name: %s}' "$INLINE_SECRET")"
}

# pod_events NS POD: "REASON<tab>MESSAGE" per event of the pod.
pod_events() {
    kctl get events -n "$1" --field-selector "involvedObject.kind=Pod,involvedObject.name=$2" \
        -o jsonpath='{range .items[*]}{.reason}{"\t"}{.message}{"\n"}{end}'
}

phase_of() { kctl get pod -n "$1" "$2" -o jsonpath='{.status.phase}' 2>/dev/null; }
pod_done() { [[ $(phase_of "$1" "$2") == Succeeded || $(phase_of "$1" "$2") == Failed ]]; }
pod_running() { [[ $(phase_of "$1" "$2") == Running ]]; }

# wait_pod NS NAME SECONDS: until it ran to completion; then its log is in
# RESULTS/NS.NAME.log and the status says whether it succeeded.
wait_pod() {
    local ns=$1 name=$2 secs=${3:-180}
    if ! wait_until "$secs" "pod $ns/$name to finish" pod_done "$ns" "$name"; then
        kctl describe pod -n "$ns" "$name" | tail -n 25
        return 1
    fi
    kctl logs -n "$ns" "$name" > "$RESULTS/$ns.$name.log" 2>&1
    [[ $(phase_of "$ns" "$name") == Succeeded ]] || { cat "$RESULTS/$ns.$name.log"; return 1; }
}

wait_running() {
    local ns=$1 name=$2 secs=${3:-180}
    wait_until "$secs" "pod $ns/$name to run" pod_running "$ns" "$name" && return 0
    kctl describe pod -n "$ns" "$name" | tail -n 25
    return 1
}

pvc_events() {
    kctl get events -n "$1" --field-selector "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=$2" \
        -o jsonpath='{range .items[*]}{.reason}{"\t"}{.message}{"\n"}{end}'
}

has_event() { pvc_events "$1" "$2" | cut -f1 | matches -x "$3"; }
pod_has_event() { pod_events "$1" "$2" | cut -f1 | matches -x "$3"; }

# model_sealed NS PVC [SECONDS]: waits (60 s unless told) for the PVC's
# ModelSealed event. A pulled model's PVC binds, and its pods run, once
# every file is verified: the seal, and its event, may come a moment later.
model_sealed() { wait_until "${3:-60}" "ModelSealed on PVC $1/$2" has_event "$1" "$2" ModelSealed; }

# What a reader pod prints: the model's checksums (paths relative to /model),
# then the outcome of a write.
READ_AND_WRITE='cd /model
find . -type f | sort | xargs sha256sum
if touch /model/e2e-write 2>/tmp/err; then echo "write: succeeded"; else echo "write: $(cat /tmp/err)"; fi'

sums_of_dir() { (cd "$1" && find . -type f | sort | xargs sha256sum); }

# split_log LOG: LOG.sums (checksum lines) and LOG.write (the write outcome).
split_log() {
    grep -v '^write: ' "$1" > "$1.sums"
    grep '^write: ' "$1" > "$1.write"
}

# What a writer pod puts in a source volume; it prints the checksums.
WRITER='set -e
mkdir -p /model/tokenizer
head -c 3000000 /dev/urandom > /model/model.safetensors
head -c 20000 /dev/urandom > /model/tokenizer/vocab.bin
echo "{\"model_type\": \"e2e\"}" > /model/config.json
sync
cd /model && find . -type f | sort | xargs sha256sum'

# sealed NS PVC: the seal's VolumeAttributesClass took effect.
sealed() { [[ $(kctl get pvc -n "$1" "$2" -o jsonpath='{.status.currentVolumeAttributesClassName}') == modelcache-sealed ]]; }

erofs() { contains "$1.write" "Read-only file system"; }

# --- MinIO (on MINIO_HOST, default loopback), with its audit log ------------------------------------------------

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

s3() {
    # s3 METHOD PATH [CURL ARGS...]: a SigV4-signed request to MinIO.
    local method=$1 path=$2
    shift 2
    curl -fsS --aws-sigv4 "aws:amz:us-east-1:s3" --user "$MINIO_USER:$MINIO_PASSWORD" \
        -X "$method" "$MINIO_URL$path" "$@"
}

# upload_dir DIR PREFIX: every file of DIR under s3://models/PREFIX/; sizes in
# RESULTS/PREFIX.sizes ("<key> <size>").
upload_dir() {
    local dir=$1 prefix=$2 f rel
    : > "$RESULTS/$prefix.sizes"
    while IFS= read -r f; do
        rel=${f#"$dir"/}
        s3 PUT "/models/$prefix/$rel" -T "$f" -o /dev/null || return 1
        echo "$prefix/$rel $(stat -c %s "$f")" >> "$RESULTS/$prefix.sizes"
    done < <(find "$dir" -type f | sort)
}

start_minio() {
    local bin audit_port
    bin=$(bash "$REPO_ROOT/tests/scripts/deps/minio.sh") || die "no MinIO binary"
    stop minio 10
    stop minio-audit 5
    rm -rf "$E2E_DIR/minio"
    mkdir -p "$E2E_DIR/minio/data"
    AUDIT=$E2E_DIR/minio/audit.jsonl
    AUDIT_QUEUE=$E2E_DIR/minio/audit-queue
    # Two audit targets post to one receiver, which writes each request's
    # entry once (e2e/lib/audit-receiver.py): one through a queue on disk,
    # one from memory, so that no one way of delivering is the only record.
    : > "$AUDIT"
    audit_port=$(free_port)
    launch minio-audit python3 "$E2E_ROOT/lib/audit-receiver.py" "$audit_port" "$AUDIT"
    MINIO_PORT=$(free_port)
    MINIO_URL=http://${MINIO_HOST:-127.0.0.1}:$MINIO_PORT
    launch minio env MINIO_ROOT_USER=$MINIO_USER MINIO_ROOT_PASSWORD=$MINIO_PASSWORD \
        MINIO_BROWSER=off MINIO_UPDATE=off MINIO_PROMETHEUS_AUTH_TYPE=public \
        MINIO_AUDIT_WEBHOOK_ENABLE=on MINIO_AUDIT_WEBHOOK_ENDPOINT="http://127.0.0.1:$audit_port/" \
        MINIO_AUDIT_WEBHOOK_QUEUE_DIR="$AUDIT_QUEUE" \
        MINIO_AUDIT_WEBHOOK_ENABLE_second=on MINIO_AUDIT_WEBHOOK_ENDPOINT_second="http://127.0.0.1:$audit_port/second" \
        "$bin" server --quiet --address "${MINIO_HOST:-127.0.0.1}:$MINIO_PORT" "$E2E_DIR/minio/data"
    wait_until 60 "MinIO on $MINIO_URL" curl -fsS "$MINIO_URL/minio/health/ready" || return 1
    # Ready can still answer a PUT with 503 for a moment (seen on a loaded
    # machine); a bucket made by an earlier try answers 409.
    bucket_made() {
        local code
        code=$(curl -sS -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:us-east-1:s3" \
            --user "$MINIO_USER:$MINIO_PASSWORD" -X PUT "$MINIO_URL/models")
        [[ $code == 200 || $code == 409 ]]
    }
    wait_until 30 "MinIO's bucket" bucket_made
}

