# shellcheck shell=bash disable=SC2154 # sourced by e2e/run, whose helpers and variables it uses
# The time-to-Ready benchmark (docs/benchmarks.md), not a CI check:
#
#   e2e/up && e2e/run bench
#
# The same model, from the same MinIO, to N replicas on the one node, three
# ways, timed from `kubectl apply` to every pod Ready:
#   copy      the KServe storage-initializer pattern: an init container copies
#             the model from MinIO into an emptyDir with s5cmd (locally built
#             image), then the main container starts
#   uri       modelcache-csi: one PVC naming the model URI, mounted by every
#             replica
#   clone     modelcache-csi: a source PVC filled from MinIO and sealed
#             beforehand (not timed), one clone per replica (a StatefulSet's
#             volumeClaimTemplates with the source as dataSource)
# For each: seconds to all Ready, bytes MinIO sent (its audit log), bytes the
# run added on the node's disk (emptyDirs, or the driver's state dir).
# Every run reads its own copy of the model in MinIO, so nothing is served
# from an earlier run's cache.
#
# `e2e/run serving` does the same with an inference-server-like main
# container (flow_serving, bench_server).
#
# Settings: BENCH_REPLICAS (default "1 4"), BENCH_MODELS (default
# "minilm synth"), BENCH_SYNTH_MIB (default 4096: the synthetic model, two
# shards), BENCH_PLOT (default docs/time-to-ready.svg).
# Figures: RESULTS/bench-ready.tsv; the plot at BENCH_PLOT.

BENCH_NS=e2e-bench
MATPLOTLIB_VERSION=3.10.8

bench_setup() {
    local bin synth
    # e2e-s3 with progressive volumes; made first, so the provisioner has
    # published its capacity before a run is timed.
    kctl delete storageclass e2e-s3-progressive --ignore-not-found >/dev/null
    kctl get storageclass e2e-s3 -o json \
        | jq '.metadata = {name: "e2e-s3-progressive"} | .parameters.progressive = "true"' \
        | kctl apply -f - >/dev/null || die "cannot create StorageClass e2e-s3-progressive"
    bin=$(bash "$REPO_ROOT/tests/bench/deps-s5cmd.sh") || die "no s5cmd"
    eval "$("$E2E_ROOT/images.sh" s5cmd "$bin" | grep '^S5CMD_')"
    ctr --address "$CTRD_SOCK" -n k8s.io images import "$S5CMD_TAR" >>"$LOGS/ctr.log" 2>&1 \
        || die "ctr images import $S5CMD_TAR failed"
    if [[ " ${BENCH_MODELS:-minilm synth} " == *" synth "* ]]; then
        synth=$E2E_DIR/bench-synth
        rm -rf "$synth" && mkdir -p "$synth"
        local half=$((${BENCH_SYNTH_MIB:-4096} / 2))
        # Incompressible and not sparse, like real weights.
        head -c $((half << 20)) /dev/urandom > "$synth/model-00001-of-00002.safetensors"
        head -c $((half << 20)) /dev/urandom > "$synth/model-00002-of-00002.safetensors"
        echo '{"architectures":["Bench"]}' > "$synth/config.json"
        upload_dir "$synth" synth || die "upload to MinIO failed"
        rm -rf "$synth"
    fi
}

# bench_copy_objects MODEL PREFIX: a server-side copy of models/MODEL under
# models/PREFIX.
bench_copy_objects() {
    local model=$1 prefix=$2 key size
    while read -r key size; do
        s3 PUT "/models/$prefix/${key#"$model"/}" -H "x-amz-copy-source: /models/$key" -o /dev/null || return 1
    done < "$RESULTS/$model.sizes"
}

bench_delete_objects() {
    local model=$1 prefix=$2 key size
    while read -r key size; do
        s3 DELETE "/models/$prefix/${key#"$model"/}" -o /dev/null || true
    done < "$RESULTS/$model.sizes"
}

# Bytes of GetObject responses under models/PREFIX/ in MinIO's audit log.
bench_origin_bytes() {
    python3 - "$AUDIT" "$1/" <<'PY'
import json, sys
audit, prefix = sys.argv[1:3]
n = 0
for line in open(audit):
    try:
        e = json.loads(line)
    except ValueError:
        continue
    api = e.get("api", {})
    if api.get("name") == "GetObject" and api.get("object", "").startswith(prefix):
        n += int(api.get("tx", 0))
print(n)
PY
}

bench_ready() { kctl get pods -n $BENCH_NS -l app=bench \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null \
    | grep -c True; }

# Bytes under the driver's sources (pulled models and source volumes).
bench_state_bytes() { du -sb "$STATE_DIR"/*/sources 2>/dev/null | awk '{n+=$1} END {printf "%.0f\n", n}'; }
# Bytes in the emptyDirs of the bench's pods.
bench_emptydir_bytes() {
    local uid n=0 b
    for uid in $(kctl get pods -n $BENCH_NS -l app=bench -o jsonpath='{.items[*].metadata.uid}'); do
        b=$(du -sb "$KUBELET_ROOT/pods/$uid/volumes/kubernetes.io~empty-dir" 2>/dev/null | cut -f1)
        n=$((n + ${b:-0}))
    done
    echo $n
}

# bench_workload KIND N POD_SPEC_EXTRA VOLUMES_OR_TEMPLATES: a Deployment
# or StatefulSet of N busybox replicas reading /model. POD_SPEC_EXTRA goes
# into the pod spec (indented 6), the last argument after it.
bench_workload() {
    local kind=$1 n=$2 extra=$3 tail=$4
    kctl apply -n $BENCH_NS -f - >/dev/null <<YAML
apiVersion: apps/v1
kind: $kind
metadata: {name: bench}
spec:
  replicas: $n
  selector: {matchLabels: {app: bench}}
$([[ $kind == StatefulSet ]] && printf '  podManagementPolicy: Parallel\n  serviceName: bench\n')
  template:
    metadata: {labels: {app: bench}}
    spec:
      terminationGracePeriodSeconds: 1
$extra
      containers:
        - name: server
          image: $BUSYBOX_IMAGE
          imagePullPolicy: Never
$(bench_server)
          volumeMounts: [{name: model, mountPath: /model, readOnly: true}]
$tail
YAML
}

# bench_server: the main container's command (indented 10). With
# BENCH_SERVER_SECONDS set (the serving flow), it behaves like an inference
# server: it starts (a sleep of that many seconds stands for imports and
# CUDA init), reads every file of the model in path order (the shards in
# order), and only then is Ready (a readiness probe). Otherwise it lists
# the model and is Ready at once.
bench_server() {
    if [[ -z ${BENCH_SERVER_SECONDS:-} ]]; then
        echo '          command: [sh, -c, "ls /model > /dev/null && exec sleep 3600"]'
        return
    fi
    cat <<EOF
          command: [sh, -c, "sleep $BENCH_SERVER_SECONDS && find /model -type f | sort | while read f; do cat \"\$f\" > /dev/null || exit 1; done && touch /tmp/loaded && exec sleep 3600"]
          readinessProbe: {exec: {command: [cat, /tmp/loaded]}, periodSeconds: 1, failureThreshold: 1000}
EOF
}

# s5cmd_env INDENT: the env list of a container that runs s5cmd against MinIO.
s5cmd_env() {
    printf '%s- {name: %s, value: %s}\n' "$1" AWS_ACCESS_KEY_ID "$MINIO_USER" \
        "$1" AWS_SECRET_ACCESS_KEY "$MINIO_PASSWORD" "$1" AWS_REGION us-east-1
}

# bench_apply METHOD MODEL N PREFIX: the workload of one run.
bench_apply() {
    local method=$1 model=$2 n=$3 prefix=$4
    case $method in
    copy)
        bench_workload Deployment "$n" "      # MinIO listens on the node's loopback, as it does for the driver.
      hostNetwork: true
      initContainers:
        - name: storage-initializer
          image: $S5CMD_IMAGE
          imagePullPolicy: Never
          env:
$(s5cmd_env "            ")
          command: [s5cmd, --endpoint-url, \"$MINIO_URL\", cp, \"s3://models/$prefix/*\", /model/]
          volumeMounts: [{name: model, mountPath: /model}]" \
            "      volumes: [{name: model, emptyDir: {}}]"
        ;;
    uri | progressive)
        pvc $BENCH_NS model "$([[ $method == uri ]] && echo e2e-s3 || echo e2e-s3-progressive)" ReadWriteOnce \
            "\"modelcache.csi.io/source\": \"s3://models/$prefix\", \"modelcache.csi.io/source-secret\": \"minio\""
        bench_workload Deployment "$n" "" \
            "      volumes: [{name: model, persistentVolumeClaim: {claimName: model, readOnly: true}}]"
        ;;
    clone)
        bench_workload StatefulSet "$n" "" "  volumeClaimTemplates:
    - metadata: {name: model}
      spec:
        storageClassName: modelcache-cache-local
        accessModes: [ReadWriteOnce]
        resources: {requests: {storage: 512Mi}}
        dataSource: {kind: PersistentVolumeClaim, name: src}"
        ;;
    esac
}

# bench_fill_source MODEL PREFIX: the clone method's source PVC, filled from
# MinIO by a pod with s5cmd and sealed; not timed.
bench_fill_source() {
    local prefix=$2
    pvc $BENCH_NS src modelcache-source-local ReadWriteOnce
    kctl apply -n $BENCH_NS -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: filler}
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
    - name: c
      image: $S5CMD_IMAGE
      imagePullPolicy: Never
      env:
$(s5cmd_env "        ")
      command: [sh, -c, "s5cmd --endpoint-url $MINIO_URL cp 's3://models/$prefix/*' /model/ && sync"]
      volumeMounts: [{name: model, mountPath: /model}]
  volumes: [{name: model, persistentVolumeClaim: {claimName: src}}]
YAML
    wait_pod $BENCH_NS filler 1800 || return 1
    kctl delete pod -n $BENCH_NS filler --wait=true --timeout=60s >/dev/null
    kctl patch pvc -n $BENCH_NS src --type merge -p '{"spec":{"volumeAttributesClassName":"modelcache-sealed"}}' >/dev/null
    wait_until 600 "the bench source to be sealed" sealed $BENCH_NS src
}

bench_clear() {
    kctl delete deployment,statefulset -n $BENCH_NS --all --wait=true --timeout=180s >/dev/null 2>&1
    wait_until 180 "bench pods to go" bash -c "[[ -z \$($BIN/kubectl --kubeconfig $E2E_DIR/api/kubeconfig get pods -n $BENCH_NS -o name) ]]"
    kctl delete pvc -n $BENCH_NS --all --wait=true --timeout=300s >/dev/null 2>&1
}

# bench_one METHOD MODEL N: one timed run; a line in bench-ready.tsv.
bench_one() {
    local method=$1 model=$2 n=$3 prefix t0 t1 disk0 secs origin disk limit
    prefix=bench-$(date +%s)-$method-$n-$model
    bench_copy_objects "$model" "$prefix" || { check "copy $model for the run" false; return 1; }
    disk0=$(bench_state_bytes)
    if [[ $method == clone ]]; then
        bench_fill_source "$model" "$prefix" || { check "the clone run's source is filled and sealed" false; return 1; }
    fi
    sync
    limit=$((1800))
    t0=$(date +%s.%N)
    bench_apply "$method" "$model" "$n" "$prefix"
    until [[ $(bench_ready) == "$n" ]]; do
        if (($(date +%s) - ${t0%.*} > limit)); then
            check "$method $model N=$n: every replica Ready within ${limit}s" false
            kctl get pods -n $BENCH_NS -o wide >&2
            bench_clear
            return 1
        fi
        sleep 0.2
    done
    t1=$(date +%s.%N)
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}')
    sleep 2 # the audit webhook posts each entry as it completes
    origin=$(bench_origin_bytes "$prefix")
    if [[ $method == copy ]]; then
        disk=$(bench_emptydir_bytes)
    else
        disk=$(($(bench_state_bytes) - disk0))
    fi
    check "$method $model N=$n: all Ready in ${secs}s; origin $origin B, disk $disk B" test "$origin" -gt 0
    printf '%s\t%s\t%s\t%.2f\t%s\t%s\t%s\n' "$model" "$method" "$n" "$secs" "$origin" "$disk" \
        "$(awk '{n += $2} END {printf "%.0f", n}' "$RESULTS/$model.sizes")" >> "$RESULTS/bench-ready.tsv"
    bench_clear
    bench_delete_objects "$model" "$prefix"
}

flow_bench() {
    bench_runs "copy uri clone" "${BENCH_PLOT:-$REPO_ROOT/docs/time-to-ready.svg}"
}

# The serving benchmark (`e2e/run serving`, docs/benchmarks.md): the same
# runs with a main container that behaves like an inference server
# (bench_server, BENCH_SERVER_SECONDS default 15): copy-per-pod, sealed (a
# model URI PVC) and progressive (the same with `progressive: "true"`).
flow_serving() {
    BENCH_SERVER_SECONDS=${BENCH_SERVER_SECONDS:-15}
    bench_runs "${BENCH_METHODS:-copy uri progressive}" "${BENCH_PLOT:-$REPO_ROOT/docs/time-to-ready-serving.svg}"
}

# bench_runs METHODS PLOT: every model, replica count and method, timed;
# the table and the plot.
bench_runs() {
    local model method n
    tenant_ns $BENCH_NS
    bench_setup
    printf 'model\tmethod\treplicas\tseconds\torigin_bytes\tdisk_bytes\tmodel_bytes\n' > "$RESULTS/bench-ready.tsv"
    note "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; MinIO, the driver, kubelet and the pods share them"
    for model in ${BENCH_MODELS:-minilm synth}; do
        for n in ${BENCH_REPLICAS:-1 4}; do
            for method in $1; do
                bench_one "$method" "$model" "$n"
            done
        done
    done
    column -t -s $'\t' "$RESULTS/bench-ready.tsv" | sed 's/^/        /' >&2
    bench_plot "$RESULTS/bench-ready.tsv" "$2"
    kctl delete namespace $BENCH_NS --wait=false >/dev/null 2>&1
}

# The driver's share of pod start-up (`e2e/run startup`, docs/benchmarks.md):
# a Deployment of BENCH_STARTUP_REPLICAS (default 50) busybox replicas on the
# one node, all reading one model already cached on it (a PVC, pulled and
# read once before, not timed), against the same Deployment with an emptyDir
# and no volume driver at all. Alternated BENCH_STARTUP_ROUNDS times (default
# 2), each timed from `kubectl apply` to every replica Ready. Figures:
# RESULTS/bench-startup.tsv.
flow_startup() {
    local n=${BENCH_STARTUP_REPLICAS:-50} rounds=${BENCH_STARTUP_ROUNDS:-2} prefix round method t0 secs
    tenant_ns $BENCH_NS
    prefix=bench-startup-$(date +%s)
    bench_copy_objects minilm "$prefix" || { check "copy the model for the run" false; return 1; }
    pvc $BENCH_NS model e2e-s3 ReadWriteOnce \
        "\"modelcache.csi.io/source\": \"s3://models/$prefix\", \"modelcache.csi.io/source-secret\": \"minio\""
    # Cached: pulled, and read once by a pod that is gone before the runs.
    bench_startup_apply cached 1
    one_ready() { [[ $(bench_ready) == 1 ]]; }
    check "the model is pulled and read once (not timed)" wait_until 600 "the first replica" one_ready || return 1
    bench_startup_clear
    printf 'method\treplicas\tround\tseconds\n' > "$RESULTS/bench-startup.tsv"
    note "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; kubelet, containerd, the driver and the pods share them"
    for round in $(seq "$rounds"); do
        for method in emptydir cached; do
            sync
            t0=$(date +%s.%N)
            bench_startup_apply $method "$n"
            until [[ $(bench_ready) == "$n" ]]; do
                if (($(date +%s) - ${t0%.*} > 900)); then
                    check "$method: $n replicas Ready within 900 s" false
                    kctl get pods -n $BENCH_NS -o wide >&2
                    return 1
                fi
                sleep 0.2
            done
            secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f", b - a}')
            check "$method, round $round: $n replicas Ready in ${secs}s" true
            printf '%s\t%s\t%s\t%s\n' $method "$n" "$round" "$secs" >> "$RESULTS/bench-startup.tsv"
            bench_startup_clear
        done
    done
    column -t -s $'\t' "$RESULTS/bench-startup.tsv" | sed 's/^/        /' >&2
    awk -F'\t' 'NR > 1 {s[$1] += $4; c[$1]++} END {
        e = s["emptydir"] / c["emptydir"]; m = s["cached"] / c["cached"]
        printf "mean: emptyDir %.2f s, cached model %.2f s; cached / emptyDir = %.2f\n", e, m, m / e }' \
        "$RESULTS/bench-startup.tsv" | tee -a "$SUMMARY" >&2
    kctl delete namespace $BENCH_NS --wait=false >/dev/null 2>&1
    bench_delete_objects minilm "$prefix"
}

# bench_startup_apply METHOD N: the Deployment of one startup run.
bench_startup_apply() {
    case $1 in
    emptydir) bench_workload Deployment "$2" "" "      volumes: [{name: model, emptyDir: {}}]" ;;
    cached) bench_workload Deployment "$2" "" \
        "      volumes: [{name: model, persistentVolumeClaim: {claimName: model, readOnly: true}}]" ;;
    esac
}

# The Deployment and its pods go; the PVC, and the model on the node, stay.
bench_startup_clear() {
    kctl delete deployment -n $BENCH_NS --all --wait=true --timeout=300s >/dev/null 2>&1
    no_pods() { [[ -z $(kctl get pods -n $BENCH_NS -o name) ]]; }
    wait_until 300 "bench pods to go" no_pods
}

# bench_plot TSV OUT: time to Ready against replicas, per model and method.
bench_plot() {
    local venv=$TOOLS/matplotlib-$MATPLOTLIB_VERSION
    if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
        rm -rf "$venv"
        python3 -m venv "$venv" && "$venv/bin/pip" install --quiet "matplotlib==$MATPLOTLIB_VERSION" \
            || { note "no matplotlib: no plot"; return 0; }
    fi
    "$venv/bin/python" "$E2E_ROOT/lib/plot-ready.py" "$1" "$2" && note "plot: $2"
}
