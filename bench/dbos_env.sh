#!/bin/sh
# Creates bench/.venv-dbos with DBOS Transact (bench/requirements-dbos.txt), apart from the project's
# virtualenv, whose pins DBOS's dependencies must not move. bench/steps.py --dbos runs this when it is missing.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
"$python" -m venv "$here/.venv-dbos"
if ! "$here/.venv-dbos/bin/pip" install -q -r "$here/requirements-dbos.txt" \
    || ! "$here/.venv-dbos/bin/python" -c "import dbos"; then
    rm -rf "$here/.venv-dbos"  # half a virtualenv would read as a ready one to bench/steps.py
    exit 1
fi
