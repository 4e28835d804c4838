#!/usr/bin/env bash
# Runs HERE, with PyPI: puts into .whl/ the cp312 manylinux wheels the GPU check needs beyond the lent
# machine's image (bench/gpu_needs.py finds them: the check's imports and a tiny CPU parity run with
# everything else refused), at the versions installed here. Then, from the device tool, one call:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
# PYTHON names the interpreter (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"

echo "finding what the GPU machine lacks (a few minutes: the parity check runs on the CPU)..." >&2
needs=$("$PY" -m bench.gpu_needs)
[ -n "$needs" ] || { echo "nothing to carry" >&2; exit 0; }

# pip matches a manylinux tag exactly, so name every glibc level the machine can load (2.17 to 2.39)
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done

rm -rf .whl && mkdir .whl
for req in $needs; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$req"
done

"$PY" -m bench.gpu_needs --check-wheels .whl
count=$(ls .whl/*.whl | wc -l)
[ "$(ls .whl/*.whl | sed 's#.*/##; s/-.*//' | sort -u | wc -l)" -eq "$count" ] || {
    echo "two versions of one package in .whl/: the install there would stop" >&2
    exit 1
}
ls -l .whl/*.whl | awk '{print $5, $9}'
echo "$count wheels, $(du -ch .whl/*.whl | tail -1 | cut -f1) in all (the working tree may carry 64 MiB)"
