// RunStead plugin for opencode (SPEC I4): hands session status events to the RunStead
// hook command, which queues them durably and returns at once. Installed into
// ~/.config/opencode/plugins/ by `python manage.py install_hooks opencode --server URL`,
// which fills in HOOK_COMMAND; set RUNSTEAD_HOOK_COMMAND (a JSON array) to override.
import { spawnSync } from "node:child_process"

const HOOK_COMMAND = ["python3", "-m", "machine.hooks", "opencode"]

const FORWARDED = new Set([
  "session.created",
  "session.status",
  "session.idle",
  "session.execution.started",
  "session.execution.succeeded",
  "session.execution.failed",
  "session.execution.interrupted",
  "permission.asked",
  "permission.updated",
  "permission.replied",
  "session.deleted",
])

function command() {
  try {
    const custom = JSON.parse(process.env.RUNSTEAD_HOOK_COMMAND || "null")
    if (Array.isArray(custom) && custom.length > 0) return custom
  } catch (error) {}
  return HOOK_COMMAND
}

// The hook runs to its end before the handler returns (as Claude Code and Gemini CLI run
// their hooks), one event at a time: opencode does not wait for one event's handler
// before calling it with the next, and hook processes started side by side finish in any
// order (a late `busy` handled after the turn's `idle` would open a turn nobody ends:
// 1.18.33 sends several `busy` and then `idle` within a second), nor does it wait for a
// pending handler when `opencode run` exits (a queued `idle` would be lost). The hook
// returns in tens of milliseconds (SPEC I1); HOOK_TIMEOUT_MS bounds a stuck one. A status
// that repeats is forwarded only when it changed, or for `busy` (I7: the agent works on)
// once per BUSY_REPEAT_MS at most.
const HOOK_TIMEOUT_MS = 5000
const BUSY_REPEAT_MS = 1000
const lastStatus = new Map()

function changed(event) {
  if (event.type !== "session.status") return true
  const id = event.properties?.sessionID
  const type = event.properties?.status?.type
  const now = Date.now()
  const last = lastStatus.get(id)
  if (last && last.type === type && (type !== "busy" || now - last.at < BUSY_REPEAT_MS)) return false
  lastStatus.set(id, { type, at: now })
  return true
}

export const RunStead = async ({ directory }) => ({
  event: async ({ event }) => {
    if (!event || !FORWARDED.has(event.type) || !changed(event)) return
    try {
      const [program, ...args] = command()
      spawnSync(program, args, {
        input: JSON.stringify({ type: event.type, properties: event.properties ?? {}, directory }),
        stdio: ["pipe", "ignore", "ignore"],
        timeout: HOOK_TIMEOUT_MS,
      })
    } catch (error) {
      // A hook never hurts its host.
    }
  },
})
