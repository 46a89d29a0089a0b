# shellcheck shell=bash disable=SC2034
# The `quickstart` flow of e2e/run-deployed: docs/quickstart.md run from the
# file itself, so the page cannot drift from the driver, then the examples
# users copy (deploy/csi-driver/examples) that this cluster can run.
#
# Every fenced block after a `<!-- quickstart:KIND NAME -->` line of the page
# is extracted at run time (never copied here):
#   run     executed as written (bash -euo pipefail), with a kubectl whose
#           default namespace is the flow's own and which, applying from
#           stdin, adds `hfEndpoint: <the Hub stand-in>` to every class of an
#           hf:// model (and to one that allows hf:// sources)
#   render  an install step this cluster cannot take (it runs the driver
#           already, and no registry holds $IMAGE): `helm install` runs as
#           `helm template`, `kubectl apply -k` as `kubectl kustomize`
# A Hub stand-in on the nodes' bridge (e2e/lib/hub-origin.py) serves every
# hf://ORG/NAME@COMMIT the page and the examples name: the real MiniLM files
# for public repos, those plus an `original/` checkpoint for gated ones
# (a repo is gated where its class names a provisioner secret), behind
# the token the flow gives as HF_TOKEN.
#
# Checks what the page promises: both installs render with the image set and
# the Helm one without a Namespace of its own; the ungated Deployment
# Available, its files the origin's (and nothing outside hfAllowPatterns
# fetched), writes refused; the gated class refused with the token under a
# wrong key (the claim's and pod's events name the gated repo and hfToken;
# the stand-in answered 401), then Available once the page's Secret exists,
# `original/` never fetched; the page's cleanup leaves no claim. Then the
# examples: the progressive class serves a Deployment; the vLLM, KServe and
# signed-model manifests pass a server-side dry run (KServe's
# InferenceService is not known here: YAML only); the vLLM class with its
# GPU-pool ModelPrefetch warms a node labelled as a GPU node; the signed
# class refuses an unsigned model; the shared-filesystem overlay renders.
#
# Sourced by e2e/run-deployed (after lib/checks.sh); needs its NS, MODEL,
# NODES_HOST_IP, RESULTS and node_name.

QS_DOC=$REPO_ROOT/docs/quickstart.md
QS_EXAMPLES=$REPO_ROOT/deploy/csi-driver/examples
QS_NS=e2e-quickstart
QS_IMAGE=registry.example.com/ml/modelcache-csi
QS_TAG=0.2.0
QS_TOKEN=hf_e2eQuickstartToken0123456789
QS_BLOCKS=(render:helm render:kustomize run:ready run:model run:wait run:look
    run:gated-secret run:gated-model run:gated-wait run:cleanup)

# qs_extract DOC DIR: each marked block of DOC as DIR/NN-KIND-NAME.sh.
qs_extract() {
    awk -v dir="$2" '
        /^<!-- quickstart:[a-z]+ [a-z0-9-]+ -->$/ {
            split($2, k, ":"); kind = k[2]; name = $3; want = 1; next
        }
        want && /^```/ {
            want = 0; inside = 1; n++
            file = sprintf("%s/%02d-%s-%s.sh", dir, n, kind, name)
            printf "" > file
            next
        }
        inside && /^```$/ { inside = 0; close(file); next }
        inside { print > file }
    ' "$1"
}

# qs_file KIND:NAME: the extracted block.
qs_file() {
    local f
    f=$(find "$QS/blocks" -name "[0-9][0-9]-${1%%:*}-${1#*:}.sh" | head -n 1)
    [[ -n $f ]] || { echo "docs/quickstart.md has no block marked quickstart:${1%%:*} ${1#*:}"; return 1; }
    echo "$f"
}

# qs_run NAME: runs the page's `run` block NAME as written, from QS/work,
# with the flow's kubectl first on PATH; its output in
# RESULTS/quickstart.NAME.log (shown when it fails).
qs_run() {
    local f rc
    f=$(qs_file "run:$1") || return 1
    (cd "$QS/work" && PATH="$QS/bin:$PATH" HF_TOKEN=$QS_TOKEN IMAGE=$QS_IMAGE bash -euo pipefail "$f") \
        > "$RESULTS/quickstart.$1.log" 2>&1
    rc=$?
    ((rc == 0)) || cat "$RESULTS/quickstart.$1.log"
    return $rc
}

# qs_render NAME: the page's `render` block NAME, with helm install and
# kubectl apply -k rendering into RESULTS/quickstart.NAME.yaml.
qs_render() {
    local f rc
    f=$(qs_file "render:$1") || return 1
    (cd "$QS/work" && PATH="$QS/render-bin:$PATH" IMAGE=$QS_IMAGE QS_OUT="$RESULTS/quickstart.$1.yaml" \
        bash -euo pipefail "$f") > "$RESULTS/quickstart.$1.log" 2>&1
    rc=$?
    ((rc == 0)) || cat "$RESULTS/quickstart.$1.log"
    return $rc
}

# The blocks' tools: a kubectl and a helm written for this run.
qs_tools() {
    local helm
    helm=$(bash "$REPO_ROOT/tests/scripts/deps/helm.sh") || return 1
    mkdir -p "$QS/bin" "$QS/render-bin" "$QS/work"
    ln -sfn "$REPO_ROOT/deploy" "$QS/work/deploy"
    "$BIN/kubectl" config view --raw --kubeconfig "$E2E_DIR/api/kubeconfig" > "$QS/kubeconfig"
    "$BIN/kubectl" --kubeconfig "$QS/kubeconfig" config set-context \
        "$("$BIN/kubectl" --kubeconfig "$QS/kubeconfig" config current-context)" --namespace "$QS_NS" >/dev/null || return 1
    {
        printf '#!/usr/bin/env bash\nset -euo pipefail\nreal=%q cfg=%q ep=%q\n' "$BIN/kubectl" "$QS/kubeconfig" "$QS_HUB"
        cat <<'EOF'
# Applied from stdin: every class of an hf:// model, or one allowing hf://
# sources, gets the Hub stand-in as its hfEndpoint.
if [[ " $* " == *" apply "* && " $* " == *" -f - "* ]]; then
    "$real" --kubeconfig "$cfg" create --dry-run=client -o json -f - \
        | jq --arg ep "$ep" 'if .kind == "List" then .items[] else . end
              | if .kind == "StorageClass"
                   and (((.parameters.source // "") | startswith("hf://"))
                        or ((.parameters.allowedSources // "") | contains("hf://")))
                then .parameters.hfEndpoint = $ep else . end' \
        | "$real" --kubeconfig "$cfg" "$@"
    exit
fi
exec "$real" --kubeconfig "$cfg" "$@"
EOF
    } > "$QS/bin/kubectl"
    {
        printf '#!/usr/bin/env bash\nset -euo pipefail\nreal=%q\n' "$BIN/kubectl"
        cat <<'EOF'
# An install the cluster cannot take: rendered instead.
if [[ ${1:-} == apply && ${2:-} == -k && $# == 3 ]]; then exec "$real" kustomize "$3" > "$QS_OUT"; fi
echo "quickstart render: unexpected kubectl $*" >&2
exit 1
EOF
    } > "$QS/render-bin/kubectl"
    {
        printf '#!/usr/bin/env bash\nset -euo pipefail\nreal=%q\n' "$helm"
        cat <<'EOF'
[[ ${1:-} == install ]] || { echo "quickstart render: unexpected helm $*" >&2; exit 1; }
shift
exec "$real" template "$@" > "$QS_OUT"
EOF
    } > "$QS/render-bin/helm"
    chmod +x "$QS/bin/kubectl" "$QS/render-bin/kubectl" "$QS/render-bin/helm"
}

# qs_hub: the Hub stand-in, serving every hf://ORG/NAME@COMMIT the page and
# the examples name; QS_HUB is its URL.
qs_hub() {
    local port uri files f specs=() gated
    port=$(free_port)
    QS_HUB=http://$NODES_HOST_IP:$port
    files=("$QS"/blocks/*.sh "$QS_EXAMPLES"/*.yaml "$QS_EXAMPLES"/*/*.yaml)
    # Gated repos: the model's files and a checkpoint the classes leave out.
    mkdir -p "$QS/gated"
    cp -r "$MODEL"/. "$QS/gated/"
    mkdir -p "$QS/gated/original"
    head -c 2097152 /dev/urandom > "$QS/gated/original/consolidated.00.pth"
    echo '{"dim": 2048}' > "$QS/gated/original/params.json"
    for uri in $(grep -ho 'hf://[A-Za-z0-9._-]*/[A-Za-z0-9._-]*@[0-9a-f]\{40\}' "${files[@]}" 2>/dev/null | sort -u); do
        gated=
        for f in $(grep -l -F -- "$uri" "${files[@]}" 2>/dev/null); do
            grep -q 'provisioner-secret-name' "$f" && gated=1
        done
        if [[ -n $gated ]]; then
            specs+=("${uri#hf://}=$QS/gated:gated")
        else
            specs+=("${uri#hf://}=$MODEL")
        fi
    done
    printf '%s\n' "${specs[@]}" > "$QS/hub.repos"
    note "the Hub stand-in serves: $(tr '\n' ' ' < "$QS/hub.repos")"
    rm -f "$QS/hub.ready"
    : > "$QS/hub.log"
    stop quickstart-hub 5
    launch quickstart-hub python3 "$E2E_ROOT/lib/hub-origin.py" "$NODES_HOST_IP" "$port" \
        "$QS/hub.ready" "$QS/hub.log" "$QS_TOKEN" "${specs[@]}"
    wait_until 60 "the Hub stand-in on $QS_HUB" test -s "$QS/hub.ready"
}

qs_events() {
    kctl get events -n "$QS_NS" -o jsonpath='{range .items[*]}{.involvedObject.kind}{"\t"}{.reason}{"\t"}{.message}{"\n"}{end}'
}

# qs_pods APP: the names of the Deployment's pods.
qs_pods() { kctl get pods -n "$QS_NS" -l "app=$1" -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}'; }

# qs_same_files APP FILE...: every pod of APP reads each FILE as the
# model's copy in QS_ORIGIN_DIR has it.
qs_same_files() {
    local app=$1 pod f want got
    shift
    for pod in $(qs_pods "$app"); do
        for f in "$@"; do
            want=$(sha256sum "$QS_ORIGIN_DIR/$f" | cut -d' ' -f1)
            got=$(kctl exec -n "$QS_NS" "$pod" -- sha256sum "/models/$f" | cut -d' ' -f1)
            [[ $got == "$want" ]] || { echo "$pod: /models/$f is $got, the origin's $want"; return 1; }
        done
    done
}

qs_ready_replicas() { [[ $(kctl get deploy -n "$QS_NS" "$1" -o jsonpath='{.status.readyReplicas}') == "$2" ]]; }

# qs_names FILE KIND: the names of FILE's objects of KIND.
qs_names() {
    kctl create --dry-run=client -o json -f "$1" 2>/dev/null \
        | jq -r --arg k "$2" 'if .kind == "List" then .items[] else . end | select(.kind == $k) | .metadata.name'
}

# qs_docs FILE: FILE's YAML documents as QS/docs/BASE.N.yaml, printed.
qs_docs() {
    local base
    base=$(basename "$1" .yaml)
    awk -v out="$QS/docs/$base" 'BEGIN {n = 0} /^---/ {n++; next} {print > (out "." n ".yaml")}' "$1"
    ls "$QS/docs/$base".*.yaml
}

# qs_class_names FILE...: the StorageClasses FILE's YAML (or a block's
# heredoc) defines.
qs_class_names() { awk '/^kind: StorageClass/ {sc = 1} sc && /^  name: / {print $2; sc = 0}' "$@" | sort -u; }

qs_install_renders() {
    local name
    for name in helm kustomize; do
        check "quickstart: the $name install block renders (run as $([[ $name == helm ]] && echo 'helm template' || echo 'kubectl kustomize'))" \
            qs_render $name || continue
        image_set() {
            local n
            n=$(grep -cE "image: \"?$QS_IMAGE:$QS_TAG\"?\$" "$RESULTS/quickstart.$1.yaml")
            ((n == 4)) || { echo "$n images name $QS_IMAGE:$QS_TAG (want the node plugin, keeper, controller, rescheduler: 4)"; return 1; }
        }
        check "quickstart: ... every driver container runs $QS_IMAGE:$QS_TAG" image_set $name
    done
    no_namespace() { ! grep -q '^kind: Namespace$' "$RESULTS/quickstart.helm.yaml"; }
    check "quickstart: the Helm install renders no Namespace of its own (--create-namespace makes it)" no_namespace
    has_namespace() { grep -q '^kind: Namespace$' "$RESULTS/quickstart.kustomize.yaml"; }
    check "quickstart: the kustomize install creates its Namespace" has_namespace
}

qs_ungated() {
    check "quickstart: block 'ready' (the driver rolled out)" qs_run ready || return 1
    check "quickstart: block 'model' (StorageClass and Deployment applied)" qs_run model || return 1
    check "quickstart: block 'wait': the Deployment is Available" qs_run wait || {
        qs_events | tail -n 20
        return 1
    }
    check "quickstart: ... both replicas Ready" qs_ready_replicas minilm 2
    QS_ORIGIN_DIR=$MODEL
    check "quickstart: every replica reads the origin's files" \
        qs_same_files minilm config.json model.safetensors tokenizer.json 1_Pooling/config.json
    check "quickstart: block 'look'" qs_run look \
        && check "quickstart: ... it lists the model, and the write is refused (Read-only file system)" bash -c \
            "grep -q '^config.json\$' '$RESULTS/quickstart.look.log' && grep -q 'Read-only file system' '$RESULTS/quickstart.look.log'"
    only_allowed() {
        local pod
        for pod in $(qs_pods minilm); do
            kctl exec -n "$QS_NS" "$pod" -- test ! -e /models/README.md || { echo "$pod has README.md"; return 1; }
        done
        ! grep -E 'all-MiniLM-L6-v2/resolve/[^ ]*/README\.md ' "$QS/hub.log"
    }
    check "quickstart: hfAllowPatterns: README.md neither fetched nor in the volume" only_allowed
    sealed_event() { qs_events | matches -P '^PersistentVolumeClaim\tModelSealed\t'; }
    check "quickstart: a claim of the Deployment says ModelSealed" wait_until 60 "ModelSealed" sealed_event
}

qs_gated() {
    # The token under a key nothing reads: refused, and said so.
    kctl -n "$NS" create secret generic modelcache-credentials --from-literal=hf_token="$QS_TOKEN" >/dev/null
    check "quickstart: block 'gated-model' (applied while the Secret keys the token as hf_token)" qs_run gated-model || return 1
    refused() {
        local ev
        ev=$(qs_events)
        grep -P '^PersistentVolumeClaim\t' <<<"$ev" | matches -F 'gated repo (HTTP 401)' \
            && grep -P '^Pod\tModelPullFailed\t' <<<"$ev" | matches -F 'hfToken'
    }
    check "quickstart: ... refused: the claim says 'gated repo (HTTP 401)', the pod ModelPullFailed naming hfToken" \
        wait_until 180 "the gated refusal" refused || qs_events | tail -n 20
    note "$(qs_events | grep -F 'gated repo' | head -n 1 | cut -c1-240)"
    check "quickstart: ... the Hub stand-in answered 401 to a request without a token" \
        grep -qE 'Llama-3\.2-1B-Instruct/resolve/[^ ]* 401 auth=no' "$QS/hub.log"
    kctl -n "$NS" delete secret modelcache-credentials >/dev/null
    check "quickstart: block 'gated-secret' (the page's Secret)" qs_run gated-secret || return 1
    check "quickstart: block 'gated-wait': the gated Deployment is Available" qs_run gated-wait || {
        qs_events | tail -n 20
        return 1
    }
    QS_ORIGIN_DIR=$QS/gated
    check "quickstart: its pod reads the gated repo's files" qs_same_files llama config.json model.safetensors
    check "quickstart: ... fetched with the token" grep -qE 'Llama-3\.2-1B-Instruct/resolve/[^ ]* 20[06] auth=yes' "$QS/hub.log"
    check "quickstart: hfIgnorePatterns: nothing under original/ was fetched" \
        bash -c "! grep -E 'Llama-3\.2-1B-Instruct/resolve/[^ ]*/original/' '$QS/hub.log'"
}

qs_examples() {
    local f name node2 dep mpf sc d
    node2=$(node_name 2)
    mkdir -p "$QS/docs"
    # A progressive class and the Deployment it serves.
    f=$QS_EXAMPLES/progressive.yaml
    if check "examples: progressive.yaml applied" bash -c "PATH=\"$QS/bin:\$PATH\" kubectl apply -f - < '$f'"; then
        dep=$(qs_names "$f" Deployment | head -n 1)
        available() { kctl wait -n "$QS_NS" --for=condition=Available "deployment/$1" --timeout=1s; }
        check "examples: ... its Deployment $dep is Available" wait_until 300 "deployment $dep" available "$dep" \
            || qs_events | tail -n 10
        kctl delete -n "$QS_NS" -f "$f" --wait=true --timeout=120s >/dev/null 2>&1
    fi
    # vLLM, KServe, the signed class: what the apiserver says of them.
    for f in "$QS_EXAMPLES"/vllm/*.yaml "$QS_EXAMPLES"/signed-model.yaml; do
        check "examples: ${f#"$QS_EXAMPLES"/} passes a server-side dry run" \
            kctl apply -n "$QS_NS" --dry-run=server -f "$f"
    done
    for d in $(qs_docs "$QS_EXAMPLES/kserve/inferenceservice.yaml"); do
        if grep -q '^kind: InferenceService' "$d"; then
            note "examples: kserve: the InferenceService is not known here (no KServe): not applied"
            continue
        fi
        grep -q '^kind:' "$d" || continue
        check "examples: kserve: $(grep -m1 '^kind:' "$d" | cut -d' ' -f2) passes a server-side dry run" \
            kctl apply -n "$QS_NS" --dry-run=server -f "$d"
    done
    # The vLLM class, warmed on a node labelled as a GPU node by the GPU-pool
    # ModelPrefetch (the Secret of the gated step holds the token).
    f=$QS_EXAMPLES/vllm/prefetch-gpu-pool.yaml
    mpf=$(qs_names "$f" ModelPrefetch | head -n 1)
    sc=$(kctl create --dry-run=client -o json -f "$f" | jq -r 'if .kind == "List" then .items[] else . end | .spec.storageClassName // empty' | head -n 1)
    for d in "$QS_EXAMPLES"/vllm/*.yaml; do
        kctl create --dry-run=client -o json -f "$d" \
            | jq 'if .kind == "List" then .items[] else . end | select(.kind == "StorageClass")'
    done > "$QS/vllm-classes.json"
    if check "examples: the vLLM class $sc applied" bash -c "PATH=\"$QS/bin:\$PATH\" kubectl apply -f - < '$QS/vllm-classes.json'"; then
        kctl label node "$node2" nvidia.com/gpu.present=true --overwrite >/dev/null
        kctl apply -f "$f" >/dev/null
        # What the walkthrough tells an admin to run.
        check "examples: ModelPrefetch $mpf warms $node2, labelled nvidia.com/gpu.present=true (kubectl wait --for=condition=Ready)" \
            kctl wait --for=condition=Ready "modelprefetch/$mpf" --timeout=240s || kctl get modelprefetch "$mpf" -o yaml | tail -n 15
        one_of_one() { [[ $(kctl get modelprefetch "$mpf" -o jsonpath='{.status.readyNodes}/{.status.desiredNodes}') == 1/1 ]]; }
        check "examples: ... one node of one selected: not $(node_name 1), unlabelled" one_of_one
        # The vLLM Deployment prefers nodes its driver labels warm for the class.
        warm_on() { [[ $(kctl get nodes -l "warm.modelcache.csi.io/$sc=true" -o jsonpath='{.items[*].metadata.name}') == "$1" ]]; }
        check "examples: ... $node2 alone is labelled warm.modelcache.csi.io/$sc, the key the vLLM Deployment prefers" \
            bash -c "grep -q 'warm.modelcache.csi.io/$sc' '$QS_EXAMPLES/vllm/llama-3.1-8b-instruct.yaml'" \
            && check "examples: ... (the label on the node)" wait_until 60 "the warm label" warm_on "$node2"
        kctl delete -f "$f" --wait=true >/dev/null 2>&1
        kctl label node "$node2" nvidia.com/gpu.present- >/dev/null
        kctl delete storageclass "$sc" --ignore-not-found >/dev/null
        check "examples: ... deleting the class takes the label off" wait_until 60 "the label's removal" warm_on ""
    fi
    check "examples: ... the vLLM class fetched nothing under original/" \
        bash -c "! grep -E 'Llama-3\.1-8B-Instruct/resolve/[^ ]*/original/' '$QS/hub.log'"
    # The signed class refuses a model that carries no signature.
    f=$QS_EXAMPLES/signed-model.yaml
    sc=$(qs_names "$f" StorageClass | head -n 1)
    if check "examples: signed-model.yaml's class $sc applied" bash -c "PATH=\"$QS/bin:\$PATH\" kubectl apply -f - < '$f'"; then
        pvc "$QS_NS" unsigned "$sc" ReadWriteOnce \
            "modelcache.csi.io/source: \"$(grep -ho 'hf://sentence-transformers/[^ "]*' "$(qs_file run:model)" | head -n 1)\""
        pod "$QS_NS" unsigned-reader unsigned 'ls /model'
        unsigned_refused() { qs_events | grep -i 'signature' | matches -iE 'PullFailed|ModelPullFailed|ProvisioningFailed'; }
        check "examples: ... it refuses an unsigned model, saying so" wait_until 180 "the refusal" unsigned_refused \
            || qs_events | tail -n 10
        note "$(qs_events | grep -i signature | head -n 1 | cut -c1-240)"
        kctl delete pod -n "$QS_NS" unsigned-reader --wait=false >/dev/null 2>&1
        kctl delete pvc -n "$QS_NS" unsigned --wait=false >/dev/null 2>&1
        kctl delete storageclass "$sc" --ignore-not-found >/dev/null
    fi
    # The shared-filesystem overlay: a real NFS server is not here; it renders.
    overlay_nfs() { "$BIN/kubectl" kustomize "$QS_EXAMPLES/shared" | grep -q 'nfs:'; }
    check "examples: shared/ (the overlay for a shared filesystem) renders, with its NFS volume" overlay_nfs
}

flow_quickstart() {
    QS=$RESULTS/quickstart
    rm -rf "$QS"
    mkdir -p "$QS/blocks"
    qs_extract "$QS_DOC" "$QS/blocks"
    local b missing=()
    for b in "${QS_BLOCKS[@]}"; do qs_file "$b" >/dev/null || missing+=("$b"); done
    check "quickstart: docs/quickstart.md has every marked block (${QS_BLOCKS[*]})" test ${#missing[@]} = 0 \
        || { note "missing: ${missing[*]}"; return 1; }
    note "blocks: $(cd "$QS/blocks" && ls | tr '\n' ' ')"
    check "quickstart: the Hub stand-in serves the page's and the examples' repos" qs_hub || return 1
    check "quickstart: the blocks' kubectl and helm are in place" qs_tools || return 1
    qs_install_renders
    # The page's Secret is made by the page: one made by an earlier flow
    # waits aside and comes back at the end.
    local saved=
    if kctl -n "$NS" get secret modelcache-credentials -o json > "$QS/credentials.json" 2>/dev/null; then
        saved=1
        kctl -n "$NS" delete secret modelcache-credentials >/dev/null
    fi
    fresh_ns "$QS_NS"
    # Classes an earlier run left name an older stand-in (parameters are
    # immutable): gone before the page makes them again.
    local classes
    classes=$(qs_class_names "$QS"/blocks/*.sh "$QS_EXAMPLES"/*.yaml "$QS_EXAMPLES"/*/*.yaml | grep -vx -e modelcache-inline -e modelcache-minilm-s3 -e 'modelcache-source-.*' -e 'modelcache-cache-.*' -e 'modelcache-.*shared')
    note "the page's and the examples' classes: $(echo $classes)"
    kctl delete storageclass $classes --ignore-not-found >/dev/null
    qs_ungated
    qs_gated
    qs_examples
    check "quickstart: block 'cleanup'" qs_run cleanup
    no_claims() { [[ -z $(kctl get pvc -n "$QS_NS" -o name) ]]; }
    check "quickstart: ... no claim is left" wait_until 120 "the claims to go" no_claims
    kctl delete namespace "$QS_NS" --wait=false >/dev/null
    kctl -n "$NS" delete secret modelcache-credentials --ignore-not-found >/dev/null
    if [[ -n $saved ]]; then
        jq 'del(.metadata.resourceVersion, .metadata.uid, .metadata.creationTimestamp, .metadata.managedFields)' \
            "$QS/credentials.json" | kctl create -f - >/dev/null
    fi
    stop quickstart-hub 5
}
