#!/usr/bin/env bash
# The GPU check (issue 33, docs/gpu.md): run on a bare GPU machine from the repository root, with no network.
# Installs only what the image lacks from the wheels in .gpu-wheels/ (`make gpu-wheels` fills it), into
# .gpu-site/ (a --target folder on PYTHONPATH: the image's own Python is left as it is), then runs tests/gpu
# and the VRAM fetch benchmark. Every step is bounded by `timeout`; the whole check stays under 8 minutes.
# Writes $OUT/gpu-check.log (everything printed) and $OUT/gpu-check.json (every step, test and figure).
#
#   dev/gpu_check.sh                 install, tests, benchmark
#   dev/gpu_check.sh --install-only  install and import check only (what can be proven on a CPU machine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-$PWD/.gpu-wheels}"
SITE="${GPU_SITE:-$PWD/.gpu-site}"
mkdir -p "$OUT" "$SITE"
[[ "${1:-}" == "--install-step" ]] || exec > >(tee "$OUT/gpu-check.log") 2>&1
export PYTHONPATH="$SITE:$PWD:$PWD/contract:$PWD/kube:$PWD/agent:$PWD/operator:$PWD/dev${PYTHONPATH:+:$PYTHONPATH}"
STEPS="$OUT/.steps"
[[ "${1:-}" == "--install-step" ]] || : >"$STEPS"
step() { # step NAME SECONDS COMMAND...: run bounded, record name, rc and seconds
    local name=$1 limit=$2 start rc
    shift 2
    echo "=== $name (at most ${limit}s): $*"
    start=$EPOCHREALTIME
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "$name $rc $(awk "BEGIN { print $EPOCHREALTIME - $start }")" >>"$STEPS"
    echo "=== $name: rc=$rc"
    return $rc
}
[[ "${1:-}" == "--install-step" ]] || echo "gpu check at $(date -u +%FT%TZ) on $(hostname); $("$PY" --version 2>&1); OUT=$OUT"
[[ "${1:-}" == "--install-step" ]] || ! command -v nvidia-smi >/dev/null || timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv

# Module to import -> the carried wheels that provide it (installed with --no-deps, only if the import fails).
# numpy is listed last: the image normally has it (torch's images do); it is carried only if `make gpu-wheels
# GPU_WHEELS_NUMPY=1` fetched it, which does not fit the 64 MiB limit together with NIXL.
NEEDS=(
    "nixl._api:nixl nixl_cu13"
    "jwt:pyjwt"
    "_cffi_backend:cffi"
    "cryptography.hazmat.primitives.asymmetric.rsa:cryptography"
    "numpy:numpy"
)
install() {
    local missing=() absent=() entry mod pkgs pkg
    for mod in torch aiohttp prometheus_client pytest; do # the image's own: never carried
        "$PY" -c "import $mod" 2>/dev/null || absent+=("$mod (the image should have it; not carried)")
    done
    for entry in "${NEEDS[@]}"; do
        mod=${entry%%:*}
        pkgs=${entry#*:}
        if ! "$PY" -c "import $mod" 2>/dev/null; then
            for pkg in $pkgs; do
                if ls "$WHEELS"/"${pkg//-/_}"-*.whl >/dev/null 2>&1; then missing+=("$pkg"); else absent+=("$pkg (no wheel in $WHEELS)"); fi
            done
        fi
    done
    if ((${#absent[@]})); then
        printf 'gpu check: missing and not installable here: %s\n' "${absent[@]}"
        return 3
    fi
    if ((${#missing[@]})); then
        echo "installing from $WHEELS into $SITE: ${missing[*]}"
        "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --target "$SITE" "${missing[@]}" || return $?
    else
        echo "nothing to install: the image has every module"
    fi
    # What the agent, the tests' loopback issuer and the tests import, each from where it resolves.
    "$PY" -c 'import importlib
for m in ("torch", "numpy", "nixl._api", "jwt", "cryptography", "aiohttp", "prometheus_client", "pytest",
          "gpuobj_agent.runtime", "gpuobj_dev.testing.agent_workload", "gpuobj_dev.testing.issuer", "gpuobj.client.state_dicts"):
    mod = importlib.import_module(m)
    print("  import", m, "ok:", getattr(mod, "__version__", ""), getattr(mod, "__file__", ""))
import sys
assert "kubernetes" not in sys.modules, "the no-cluster path imported kubernetes"
import torch
print(f"  torch {torch.__version__} CUDA {torch.version.cuda}; devices visible: {torch.cuda.device_count()}")'
}

if [[ "${1:-}" == "--install-step" ]]; then # the install, run by `step` below under its timeout
    install
    exit $?
fi
step install 120 "$0" --install-step
rc_install=$?
if [[ "${1:-}" != "--install-only" && $rc_install -eq 0 ]]; then
    step tests 330 "$PY" -m pytest tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -q -rA \
        -o junit_logging=system-out --junitxml="$OUT/gpu-tests.xml"
    step bench 150 "$PY" -m gpuobj_dev.gpu_bench --json "$OUT/gpu-bench.json"
fi

"$PY" - "$OUT" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
steps = [dict(zip(("step", "rc", "seconds"), line.split())) for line in (out / ".steps").read_text().splitlines()]
result = {"steps": [{"step": s["step"], "rc": int(s["rc"]), "seconds": round(float(s["seconds"]), 1)} for s in steps]}
junit = out / "gpu-tests.xml"
if junit.exists():
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome, message = kind, (node.get("message") or "")[:500]
                break
        row = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time", 0))}
        if outcome != "passed":
            row["message"] = message
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            row["figures"] = props
        tests.append(row)
    result["tests"] = tests
bench = out / "gpu-bench.json"
if bench.exists():
    result["bench"] = json.loads(bench.read_text())
result["ok"] = all(s["rc"] == 0 for s in result["steps"])
(out / "gpu-check.json").write_text(json.dumps(result, indent=2))
print(json.dumps({"ok": result["ok"], "steps": result["steps"]}))
PYEOF
rm -f "$STEPS"
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$OUT/gpu-check.json"
