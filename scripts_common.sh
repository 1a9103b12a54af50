# Sourced by ./run and ./test: create the virtualenv if missing and install $REQUIREMENTS
# (./run: requirements.txt; ./test: requirements-dev.txt, which includes requirements.txt)
# when either requirements file changed since the last install of that file.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}
REQUIREMENTS=${REQUIREMENTS:-requirements.txt}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-${REQUIREMENTS%.txt}.sha256
want=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing $REQUIREMENTS into .venv ..."
  .venv/bin/pip install -q --disable-pip-version-check -r "$REQUIREMENTS" 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$want" > "$stamp"
fi
