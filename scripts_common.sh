# Sourced by ./run and ./test: create the virtualenv if missing and install requirements
# when requirements.txt changed since the last install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing requirements into .venv ..."
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$want" > "$stamp"
fi
