// RunStead plugin for opencode (SPEC I4): hands session status events to the RunStead
// hook command, which queues them durably and returns at once. Installed into
// ~/.config/opencode/plugins/ by `python manage.py install_hooks opencode --server URL`,
// which fills in HOOK_COMMAND; set RUNSTEAD_HOOK_COMMAND (a JSON array) to override.
import { spawn } from "node:child_process"

const HOOK_COMMAND = ["python3", "-m", "sessions_app.hooks", "opencode"]

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

export const RunStead = async ({ directory }) => ({
  event: async ({ event }) => {
    if (!event || !FORWARDED.has(event.type)) return
    try {
      const [program, ...args] = command()
      const child = spawn(program, args, { stdio: ["pipe", "ignore", "ignore"], detached: false })
      child.on("error", () => {})
      child.stdin.on("error", () => {})
      child.stdin.end(JSON.stringify({ type: event.type, properties: event.properties ?? {}, directory }))
    } catch (error) {
      // A hook never hurts its host.
    }
  },
})
