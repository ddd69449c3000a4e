#!/usr/bin/env bash
# Builds ppma's sdist and wheel (`python -m build --no-isolation`), installs the wheel into a fresh virtualenv beside
# the pinned torch, and smoke-tests it from a directory outside the source tree: an op against its reference, a
# model forward, a console script's --help, and that `ppma` was imported from the virtualenv with its compiled
# operators. Checks that the sdist carries every C++/CUDA source and header of csrc/ (MANIFEST.in). Run by .ci/run.
#
#   bash scripts/check_wheel.sh                   # sdist, then the wheel from the source tree (reuses build/)
#   CHECK_WHEEL_FROM_SDIST=1 bash scripts/check_wheel.sh   # the wheel from the unpacked sdist (a full compile)
#
# Needs the build tools of scripts/setup.sh (setuptools, wheel, ninja, build) in the environment of ${PYTHON:-python3}.
# The virtualenv gets torch==$TORCH_VERSION (default: the torch of that environment), then ppma's other dependencies
# and torch's at the versions installed in that environment (pinned, --no-deps), then the wheel with --no-deps. MAX_JOBS limits the compile jobs
# (default 2). Exits non-zero on any failure; the work folder (a temporary directory) is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-2}
TORCH_VERSION=${TORCH_VERSION:-$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ppma-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
case "$WORK/" in "$ROOT"/*) echo "[check_wheel] the work folder $WORK lies inside the source tree" >&2; exit 1;; esac
t0=$(date +%s)

echo "[check_wheel] building the sdist"
"$PY" -m build --no-isolation --sdist --outdir "$WORK/dist" . >"$WORK/build-sdist.log" 2>&1 \
  || { tail -40 "$WORK/build-sdist.log"; exit 1; }
sdist=$(ls "$WORK"/dist/*.tar.gz)
echo "[check_wheel] the sdist carries every file of csrc/"
"$PY" - "$sdist" <<'EOF'
import subprocess, sys, tarfile
members = {m.split("/", 1)[1] for m in tarfile.open(sys.argv[1]).getnames() if "/" in m}
tracked = subprocess.run(["git", "ls-files", "csrc"], capture_output=True, text=True).stdout.split()
if not tracked:  # not a git checkout: the files on disk
    import pathlib
    tracked = [p.as_posix() for p in pathlib.Path("csrc").rglob("*") if p.is_file()]
missing = sorted(set(tracked) - members)
if missing or not tracked:
    sys.exit(f"[check_wheel] the sdist lacks {len(missing)} file(s) of csrc/: {missing[:10]}")
for needed in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "ppma/__init__.py"):
    if needed not in members:
        sys.exit(f"[check_wheel] the sdist lacks {needed}")
print(f"[check_wheel]   {len(tracked)} csrc files, {len(members)} members")
EOF

if [ "${CHECK_WHEEL_FROM_SDIST:-0}" = 1 ]; then
  echo "[check_wheel] building the wheel from the sdist (MAX_JOBS=$MAX_JOBS)"
  mkdir "$WORK/src" && tar -xzf "$sdist" -C "$WORK/src"
  src=$(ls -d "$WORK"/src/*/)
else
  echo "[check_wheel] building the wheel from the source tree (MAX_JOBS=$MAX_JOBS)"
  src=.
fi
tw=$(date +%s)
"$PY" -m build --no-isolation --wheel --outdir "$WORK/dist" "$src" >"$WORK/build-wheel.log" 2>&1 \
  || { tail -40 "$WORK/build-wheel.log"; exit 1; }
wheel=$(ls "$WORK"/dist/*.whl)
echo "[check_wheel]   $(basename "$wheel") in $(( $(date +%s) - tw )) s"
"$PY" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
if not any(n.startswith("ppma/_C") and n.endswith(".so") for n in names):
    sys.exit("[check_wheel] the wheel has no compiled ppma/_C library")
if any(n.startswith(("tests/", "benchmarks/", "csrc/")) for n in names):
    sys.exit("[check_wheel] the wheel carries files outside the ppma package")
EOF

echo "[check_wheel] a fresh virtualenv with torch==$TORCH_VERSION and the wheel"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
tv=$(date +%s)
# The installed versions of the requirements of torch and of ppma's other dependencies, and of theirs (markers
# evaluated for this interpreter): the virtualenv gets exactly what the tests ran with.
pins=$("$PY" - <<'EOF'
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement

seen, todo = {}, ["torch", "numpy", "pyyaml", "tqdm"]
while todo:
    name = todo.pop()
    dist = distribution(name)
    key = dist.metadata["Name"].lower()
    if key in seen:
        continue
    seen[key] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            try:
                distribution(req.name)
            except PackageNotFoundError:
                raise SystemExit(f"[check_wheel] {key} requires {req.name}, which is not installed")
            todo.append(req.name)
print(" ".join(f"{k}=={v}" for k, v in sorted(seen.items()) if k != "torch"))
EOF
)
"$VPY" -m pip install --disable-pip-version-check -q --no-deps "torch==$TORCH_VERSION" $pins
"$VPY" -m pip install --disable-pip-version-check -q --no-deps "$wheel"
"$VPY" -m pip check
echo "[check_wheel]   virtualenv ready in $(( $(date +%s) - tv )) s"

echo "[check_wheel] smoke test from $WORK/run"
mkdir "$WORK/run" && cd "$WORK/run"
PPMA_SOURCE_TREE="$ROOT" "$VPY" - <<'EOF'
import os, sys, sysconfig
import torch
import ppma

where = os.path.realpath(ppma.__file__)
site = os.path.realpath(sysconfig.get_paths()["purelib"])
root = os.path.realpath(os.environ["PPMA_SOURCE_TREE"])
assert where.startswith(site + os.sep), f"ppma imported from {where}, not from the virtualenv's {site}"
assert not where.startswith(root + os.sep), f"ppma imported from the source tree: {where}"
assert ppma.has_ext(), "the wheel's compiled operators did not load"

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 6, 7, 2, 8, generator=g, requires_grad=True) for _ in range(3))
la, lb = (-torch.rand(2, 6, 7, 2, generator=g) for _ in range(2))
out = ppma.ops.polyline_attention(q, k, v, la, lb)
ref = ppma.ops.reference.polyline_attention_ref(q, k, v, la, lb)
err = (out - ref).abs().max().item()
assert err < 1e-5, f"polyline_attention differs from its reference by {err}"
out.sum().backward()
assert q.grad is not None and torch.isfinite(q.grad).all()

model = ppma.create_model("ppma_tiny", num_classes=10, embed_dims=(16, 32, 32, 32), depths=(1, 1, 1, 1),
                          num_heads=(1, 2, 2, 2)).eval()
with torch.inference_mode():
    logits = model(torch.randn(2, 3, 64, 64, generator=g))
assert logits.shape == (2, 10) and torch.isfinite(logits).all(), logits.shape
print(f"[check_wheel]   ppma {ppma.__version__} from {where}; op error {err:.1e}; model logits {tuple(logits.shape)}")
EOF
"$WORK/venv/bin/ppma-convert" --help >/dev/null
echo "[check_wheel]   ppma-convert --help: ok"
echo "[check_wheel] passed in $(( $(date +%s) - t0 )) s"
