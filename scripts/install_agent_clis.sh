#!/usr/bin/env bash
# Installs the real agent CLIs the tests drive offline (SPEC G, I; ../shared/AGENTS.md):
# Claude Code from the npm registry, pinned, into var/agent-clis (idempotent). The tests
# find it at var/agent-clis/node_modules/.bin/claude (or $RUNSTEAD_CLAUDE_BIN).
set -euo pipefail
cd "$(dirname "$0")/.."
CLAUDE_CODE_VERSION=2.1.328
prefix=var/agent-clis
bin=$prefix/node_modules/.bin/claude
if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "^$CLAUDE_CODE_VERSION"; then
  exit 0
fi
command -v npm >/dev/null || { echo "npm is needed to install Claude Code" >&2; exit 1; }
mkdir -p "$prefix"
npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >/dev/null
"$bin" --version
