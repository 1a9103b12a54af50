#!/usr/bin/env bash
# Installs the real agent CLIs the tests drive offline (SPEC G1, I; ../shared/AGENTS.md),
# pinned, once per machine, into var/agent-clis:
#   - from the npm registry: Claude Code, Codex, Gemini CLI, opencode (node_modules/.bin/);
#   - from PyPI: aider, into its own virtualenv var/agent-clis/aider (never the project's .venv);
#   - what opencode npm-installs into a config folder holding a plugin (@opencode-ai/plugin
#     at opencode's version), into var/agent-clis/opencode-plugin-deps: the opencode hook
#     tests copy it in, so no run waits for that install (about 70 s without a registry).
# Idempotent and fast when everything is there: versions are read from the installed
# package metadata (no CLI is started). The tests find the binaries through
# tests/agent_clis.py (or $RUNSTEAD_<NAME>_BIN). The pins are the presets' tested versions
# (machine/worker/presets.py `tested_version`; tests/test_agent_cli_versions.py checks they agree).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=var/agent-clis
NPM_PACKAGES=(
  "@anthropic-ai/claude-code@2.1.328"
  "@openai/codex@0.169.0"
  "@google/gemini-cli@0.61.0"
  "opencode-ai@1.18.33"
)
AIDER_VERSION=0.86.2
OPENCODE_PLUGIN_DEPS=$prefix/opencode-plugin-deps

installed_npm_version() {  # $1 = package name [$2 = prefix] -> its installed version, or nothing
  local manifest="${2:-$prefix}/node_modules/$1/package.json"
  [ -f "$manifest" ] || return 0
  sed -n 's/^ *"version": *"\([^"]*\)".*/\1/p' "$manifest" | head -n 1
}

missing=()
for spec in "${NPM_PACKAGES[@]}"; do
  name=${spec%@*}
  version=${spec##*@}
  [ "$(installed_npm_version "$name")" = "$version" ] || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v npm >/dev/null || { echo "npm is needed to install ${missing[*]}" >&2; exit 1; }
  mkdir -p "$prefix"
  echo "installing ${missing[*]} into $prefix"
  npm install --prefix "$prefix" --save-exact --no-audit --no-fund --loglevel=error "${missing[@]}" >/dev/null
fi

opencode_version=$(installed_npm_version opencode-ai)
if [ "$(installed_npm_version @opencode-ai/plugin "$OPENCODE_PLUGIN_DEPS")" != "$opencode_version" ]; then
  echo "installing @opencode-ai/plugin@$opencode_version into $OPENCODE_PLUGIN_DEPS"
  mkdir -p "$OPENCODE_PLUGIN_DEPS"
  npm install --prefix "$OPENCODE_PLUGIN_DEPS" --save-exact --no-audit --no-fund --loglevel=error \
    "@opencode-ai/plugin@$opencode_version" >/dev/null
fi

aider_venv=$prefix/aider
if ! ls "$aider_venv"/lib/python3*/site-packages/aider_chat-"$AIDER_VERSION".dist-info >/dev/null 2>&1; then
  python=
  for candidate in python3.12 python3.11 python3.10 python3; do  # aider-chat supports 3.10-3.12
    if "$candidate" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12)' >/dev/null 2>&1; then
      python=$(command -v "$candidate"); break
    fi
  done
  [ -n "$python" ] || { echo "aider needs Python 3.10-3.12" >&2; exit 1; }
  echo "installing aider-chat==$AIDER_VERSION into $aider_venv ($python)"
  "$python" -m venv "$aider_venv"
  "$aider_venv/bin/pip" install --quiet --disable-pip-version-check "aider-chat==$AIDER_VERSION"
fi
