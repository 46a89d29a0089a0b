#!/usr/bin/env bash
# The Helm chart renders exactly the objects of the kustomize install, both
# ways it ships: default values against deploy/csi-driver/base, and
# shared.hostPath=/mnt/models against the base with components/shared.
# Compared object by object (kind, namespace, name; then the whole object,
# parsed, so only YAML formatting may differ). Prints one line per object and
# "helm-chart: N passed, M failed" for the suite's summary. First, values the
# chart's schema must refuse.
#
#   tests/scripts/helm-chart.sh [KUBECTL]   (default: the e2e tools' kubectl)
source "$(dirname "$0")/lib.sh"
kubectl=${1:-$("$ROOT/e2e/k8s/build.sh" kubectl | tail -n1)/kubectl}
helm=$(bash "$ROOT/tests/scripts/deps/helm.sh")
# PyYAML in a venv of its own: the host's python3 need not have it.
python=$(pip_venv PyYAML 6.0.3 yaml)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$helm" lint "$ROOT/deploy/helm/modelcache-csi" > "$work/lint.txt" 2>&1 || { cat "$work/lint.txt"; echo "helm-chart: 0 passed, 1 failed (helm lint)"; exit 1; }
# A value the chart does not know, or of the wrong shape, is refused by its
# schema (values.schema.json) with the value's path, before anything renders.
schema_passed=0 schema_failed=0
for bad in sharedHostPath=/mnt/models:sharedHostPath logFormat=xml:/logFormat \
    shared.hostPath=mnt/models:/shared/hostPath node.cacheCapacity.local=1.5T:/node/cacheCapacity/local \
    node.minFree=110%:/node/minFree peer.enabled=maybe:/peer/enabled; do
  value=${bad%:*} path=${bad##*:}
  if ! "$helm" template modelcache-csi "$ROOT/deploy/helm/modelcache-csi" --set "$value" > /dev/null 2> "$work/refused.txt" \
      && grep -qF "$path" "$work/refused.txt"; then
    echo "PASS schema: --set $value is refused, naming $path"; schema_passed=$((schema_passed + 1))
  else
    echo "FAIL schema: --set $value is not refused naming $path"; cat "$work/refused.txt"; schema_failed=$((schema_failed + 1))
  fi
done
export schema_passed schema_failed
"$helm" template modelcache-csi "$ROOT/deploy/helm/modelcache-csi" > "$work/helm.yaml"
"$kubectl" kustomize "$ROOT/deploy/csi-driver/base" > "$work/kustomize.yaml"
"$helm" template modelcache-csi "$ROOT/deploy/helm/modelcache-csi" --set shared.hostPath=/mnt/models > "$work/helm-shared.yaml"
# A user's overlay, as components/shared says: relative paths, since
# kustomize takes no absolute one.
mkdir "$work/shared"
rel=$(realpath --relative-to="$work/shared" "$ROOT/deploy/csi-driver")
printf 'resources: [%s/base]\ncomponents: [%s/components/shared]\n' "$rel" "$rel" > "$work/shared/kustomization.yaml"
"$kubectl" kustomize "$work/shared" > "$work/kustomize-shared.yaml"
"$python" - defaults "$work/helm.yaml" "$work/kustomize.yaml" shared "$work/helm-shared.yaml" "$work/kustomize-shared.yaml" <<'PY'
import sys, yaml

def objects(path):
    out = {}
    for doc in yaml.safe_load_all(open(path)):
        if not doc:
            continue
        md = doc.get("metadata", {})
        out[(doc["kind"], md.get("namespace", ""), md["name"])] = doc
    return out

import os
passed, failed = int(os.environ["schema_passed"]), int(os.environ["schema_failed"])
args = sys.argv[1:]
for label, helm, kust in zip(args[0::3], map(objects, args[1::3]), map(objects, args[2::3])):
    for key in sorted(set(helm) | set(kust)):
        name = label + ": " + "/".join(k for k in key if k)
        if key not in helm:
            print(f"FAIL {name}: in the kustomize base, not in the chart"); failed += 1
        elif key not in kust:
            print(f"FAIL {name}: in the chart, not in the kustomize base"); failed += 1
        elif helm[key] != kust[key]:
            print(f"FAIL {name}: differs"); failed += 1
            a, b = yaml.safe_dump(helm[key]).splitlines(), yaml.safe_dump(kust[key]).splitlines()
            import difflib
            for line in difflib.unified_diff(b, a, "kustomize", "helm", lineterm="", n=1):
                print("    " + line)
        else:
            print(f"PASS {name}"); passed += 1
print(f"helm-chart: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
