#!/usr/bin/env bash
# Fill deploy/wheelhouse/ with every wheel the image needs, so deploy/Dockerfile can build with
# no package index at all (--build-arg WHEELS_ONLY=1): for air-gapped clusters, or a build
# whose pip cannot reach an index.
#
#   bash deploy/images/wheelhouse.sh [TORCH_REQUIREMENT]    # default: torch==2.14.1
#   bash deploy/images/wheelhouse.sh 'torch==2.13.0+cpu'    # e.g. a CPU build from a local find-links
#
# Runs on any machine whose pip reaches an index (or has the wheels in its find-links) and whose
# Python has the image's version (cp311 for the Debian bookworm and python:3.11 bases); set
# PYTHON_VERSION=3.12 for another (pip then picks wheels for that version, binary only).
set -euo pipefail
cd "$(dirname "$0")/../.."

torch="${1:-torch==2.14.1}"
out=deploy/wheelhouse
target=()
if [ -n "${PYTHON_VERSION:-}" ]; then
    target=(--python-version "$PYTHON_VERSION" --platform manylinux_2_28_x86_64
            --platform manylinux2014_x86_64 --only-binary=:all:)
fi
mkdir -p "$out"
# elasticctl's own dependencies and those of its `train` extra (the image's install), read from
# pyproject.toml, so this list cannot drift from it.
mapfile -t requirements < <(python3 - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
for requirement in (project["project"]["dependencies"] + project["project"]["optional-dependencies"]["train"]
                    + project["build-system"]["requires"]):
    if not requirement.startswith("torch"):
        print(requirement)
PY
)
python3 -m pip download --quiet --dest "$out" "${target[@]}" "$torch" "${requirements[@]}" wheel
echo "$out: $(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1)"
