#!/usr/bin/env bash
# Runs the llmq-server tests (pytest) in a virtual environment under $BUILD_DIR/tests/server-venv,
# made once from requirements.txt and reused while requirements.txt is unchanged.
#
#   BUILD_DIR=build LLMQ_BIN_DIR=build bash tests/server/run.sh [pytest args, e.g. test_openai.py -k stop]
#
# CTest calls it with LLMQ_BIN_DIR (where llmq-server and llmq-convert are), LLMQ_SHARED_DIR,
# LLMQ_MODELS_DIR and BUILD_DIR set (tests/CMakeLists.txt).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
export BUILD_DIR=${BUILD_DIR:-$repo/build}
export LLMQ_BIN_DIR=${LLMQ_BIN_DIR:-$BUILD_DIR}
# LLMQ_SERVER_REQUIREMENTS picks another requirements file of this folder (requirements-clients.txt:
# the client libraries of test_clients.py, whose pins clash with requirements.txt's openai), each
# in a venv of its own.
reqs=${LLMQ_SERVER_REQUIREMENTS:-requirements.txt}
venv=$BUILD_DIR/tests/server-venv
[ "$reqs" != requirements.txt ] && venv=$BUILD_DIR/tests/server-venv-${reqs%.txt}
mkdir -p "$BUILD_DIR/tests"

# One venv build at a time (CTest may start several server tests together).
exec 9>"$BUILD_DIR/tests/server-venv.lock"
flock 9
if ! cmp -s "$here/$reqs" "$venv/.requirements.done" 2>/dev/null; then
  echo "run.sh: creating $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/$reqs"
  cp "$here/$reqs" "$venv/.requirements.done"
fi
flock -u 9

export PYTHONDONTWRITEBYTECODE=1
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"
cd "$here"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=8 "$@"
