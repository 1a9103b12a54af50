"""The direction of dependencies (README "Layout"), checked on the source.

Every ``.py`` of the project's packages is parsed with ``ast``; imports at module level and
inside functions alike become edges of one module graph. The rules:

- no cycle between modules;
- the packages form layers, each importing only from the layers below it:
  ``machine`` < ``core`` < ``tasks_app`` < ``notifications`` < ``sessions_app`` < ``board`` < ``config``
  (``core`` imports no app; no app imports ``config``, which composes them all; sessions
  meet the task core through ``tasks_app/signals.py``);
- services import no ``api`` module; the wire shapes import no DRF;
- ``machine`` (what runs on the owner's machine: worker, hooks, launcher, protocol) is a
  program of its own below every layer: it imports no framework and nothing of the service
  side, and the service side imports only the ``machine.protocol`` package from it, except the thin
  commands that start the worker, pair it or install the hooks, and the hooks' old entry
  point (``sessions_app/hooks/__main__.py``, kept for entries older installs wrote);
- the ``machine.protocol`` package (the contract's numbers and R4's ``Backoff``, and in
  ``machine.protocol.shapes`` its messages and receipts) imports only the standard library,
  so the worker, the hooks and the service share it;
- the agent hooks (``machine/hooks/``) import, of the project, only themselves and
  ``machine.protocol`` (a hook starts in milliseconds, I1).
"""
import ast
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("machine", "core", "tasks_app", "notifications", "sessions_app", "board", "config")
PACKAGES = LAYERS
# The service-side modules that may import more of ``machine`` than its protocol: the
# commands that start it (worker, pairing, hooks, turn markers), and the forwarder of hook entries older installs wrote.
MACHINE_STARTERS = {
    "tasks_app.management.commands.worker",
    "tasks_app.management.commands.pair_worker",
    "tasks_app.management.commands.demo_setup",
    "sessions_app.management.commands.install_hooks",
    "sessions_app.management.commands.turn",
    "sessions_app.hooks.__main__",
}
FRAMEWORKS = ("django", "rest_framework", "drf_spectacular", "channels", "channels_redis", "daphne", "asgiref")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(sources: dict[str, tuple[str, bool]]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``sources``: module name -> (source text, is a package). Returns (project edges,
    external top-level packages) per module, from every import statement anywhere in the
    module (module level, functions, methods, conditionals)."""
    names = set(sources)
    edges: dict[str, set[str]] = {name: set() for name in names}
    external: dict[str, set[str]] = {name: set() for name in names}

    def add(module: str, target: str) -> None:
        if target.split(".")[0] in PACKAGES:
            # The longest prefix that is one of our modules (``a.b.c`` may be a name in ``a.b``).
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges[module].add(target)
        else:
            external[module].add(target.split(".")[0])

    for module, (text, is_package) in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(module, alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module
                for alias in node.names:
                    candidate = f"{prefix}.{alias.name}"
                    add(module, candidate if candidate in names else prefix)
    return edges, external


def project_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            sources[module_name(path, ROOT)] = (path.read_text(), path.name == "__init__.py")
    return sources


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


EDGES, EXTERNAL = import_graph(project_sources())


def offending(source_filter, target_filter) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in EDGES.items()
        if source_filter(module)
        for target in targets
        if target_filter(target)
    )


def _in(package: str):
    return lambda name: name == package or name.startswith(package + ".")


def test_guard_sees_every_module_and_function_level_imports():
    """The graph is built from the real tree: a module-level edge and a function-level
    one that exist today are both present."""
    assert len(EDGES) > 60
    assert "tasks_app.services.transitions" in EDGES["tasks_app.services.cancel"]
    assert "sessions_app.receivers" in EDGES["sessions_app.apps"]  # imported inside ready()


def test_cycle_finder_sees_a_cycle_hidden_in_a_function():
    """The guard fails when someone adds a cycle, even one dodged inside a function."""
    sources = {
        "tasks_app": ("", True),
        "tasks_app.a": ("from tasks_app import b\n", False),
        "tasks_app.b": ("def f():\n    from tasks_app.c import g\n", False),
        "tasks_app.c": ("from . import a\n", False),
        "tasks_app.d": ("import tasks_app.a\n", False),
    }
    edges, _ = import_graph(sources)
    assert cycles(edges) == [["tasks_app.a", "tasks_app.b", "tasks_app.c"]]


def test_imports_have_no_cycle():
    assert cycles(EDGES) == []


def test_services_import_no_api_module():
    def is_service(name: str) -> bool:
        return ".services" in f".{name}" and name.split(".")[-1] != "api"

    def is_api(name: str) -> bool:
        return "api" in name.split(".")

    assert offending(is_service, is_api) == []


def reachable(start: list[str]) -> set[str]:
    """``start`` and every project module it imports, directly or not."""
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(EDGES.get(name, ()))
    return seen


def test_wire_shapes_import_no_drf():
    """The shapes modules, and everything of the project they import (``core.wire``, the
    models), import no DRF: the schema is generated from them (``core.schema``), not the
    other way round."""
    shapes = [name for name in EXTERNAL if name.split(".")[-1] == "shapes"]
    assert sorted(shapes) == ["board.shapes", "machine.protocol.shapes", "notifications.shapes", "sessions_app.shapes",
                              "tasks_app.shapes"]
    closure = reachable(shapes)
    assert "core.wire" in closure
    assert {name: sorted(EXTERNAL[name] & {"rest_framework", "drf_spectacular"}) for name in closure} == {
        name: [] for name in closure
    }
    assert offending(lambda name: name in closure, lambda target: "api" in target.split(".")) == []


def layer(name: str) -> int:
    return LAYERS.index(name.split(".")[0])


def test_layers_import_only_downwards():
    """``core`` sees no app, ``tasks_app`` no sessions, no app sees ``config``."""
    upward = sorted(
        f"{module} -> {target}" for module, targets in EDGES.items() for target in targets if layer(target) > layer(module)
    )
    assert upward == []


def test_layer_guard_sees_an_upward_import():
    """A synthetic app module importing ``config`` is reported (the guard can fail)."""
    edges, _ = import_graph({"config": ("", True), "config.urls": ("", False),
                             "tasks_app": ("", True), "tasks_app.x": ("from config import urls\n", False)})
    assert [f"{m} -> {t}" for m, ts in edges.items() for t in ts if layer(t) > layer(m)] == ["tasks_app.x -> config.urls"]


def test_the_service_imports_only_the_protocol_from_machine():
    """Apart from the commands that start the owner's-machine program, the service side
    knows ``machine`` by its protocol package alone."""
    machine, protocol = _in("machine"), _in("machine.protocol")
    assert offending(lambda name: not machine(name) and name not in MACHINE_STARTERS,
                     lambda target: machine(target) and not protocol(target)) == []


def test_machine_imports_no_framework_and_no_app():
    """``machine`` could ship alone: no Django, DRF, Channels, and no service module."""
    machine = _in("machine")
    assert offending(machine, lambda target: not machine(target)) == []
    assert {name: sorted(EXTERNAL[name] & set(FRAMEWORKS)) for name in EXTERNAL if machine(name)} == {
        name: [] for name in EXTERNAL if machine(name)
    }
    protocol = _in("machine.protocol")
    assert {name for name in EXTERNAL if protocol(name)} >= {"machine.protocol", "machine.protocol.shapes"}
    assert {name: EXTERNAL[name] - sys.stdlib_module_names for name in EXTERNAL if protocol(name)} == {
        name: set() for name in EXTERNAL if protocol(name)
    }
    assert offending(protocol, lambda target: not protocol(target)) == []


# What the worker and the hooks share (issue 39): the outbox and its sender, the atomic
# write and the settings reader, each loading only the standard library's ``os``.
MACHINE_SHARED = {"machine", "machine.protocol", "machine.outbox", "machine.files", "machine.settings",
                  "machine.inbox"}  # T2-T5: the sessions' local inbox (worker, wrapper, Stop hook)


def test_hooks_import_only_the_hooks_and_the_protocol():
    """A hook starts in milliseconds (I1, I7): of the project it imports only its own
    package, ``machine.protocol`` and the shared modules, nothing of the worker."""
    hooks = _in("machine.hooks")
    assert offending(hooks, lambda target: not hooks(target) and target not in MACHINE_SHARED) == []


def test_machine_guard_sees_an_app_import():
    """The guard can fail: a synthetic machine module importing an app's models is reported."""
    edges, _ = import_graph({"machine": ("", True), "machine.x": ("from tasks_app import models\n", False),
                             "tasks_app": ("", True), "tasks_app.models": ("", False)})
    assert [f"{m} -> {t}" for m, ts in edges.items() for t in ts if m.startswith("machine")] == [
        "machine.x -> tasks_app.models"]


# --- tests: shared fixtures and helpers live in conftest.py and helper modules ------------


def imported_test_modules(module: str, text: str) -> list[str]:
    """The other ``tests.test_*`` modules that ``module`` (a module of ``tests``) imports,
    anywhere in it: ``import tests.test_x``, ``from tests.test_x import y``, ``from tests
    import test_x``, ``from .test_x import y``, ``from . import test_x``."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = ".".join(p for p in ("tests" if node.level else "", node.module or "") if p)
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "tests" and parts[1].startswith("test_"):
                found.add(".".join(parts[:2]))
    found.discard(module)
    return sorted(found)


def test_no_test_module_imports_another_test_module():
    """A fixture or helper two test modules share belongs in ``tests/conftest.py`` or a
    helper module (``tests/live.py``, ``tests/factories.py``, ``tests/browser.py``, ...):
    importing a test module runs its module code and collects its fixtures twice."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        module = module_name(path, ROOT)
        if imported := imported_test_modules(module, path.read_text()):
            found[module] = imported
    assert found == {}


def test_test_import_guard_sees_every_form():
    """The guard can fail: each way of importing a test module is reported, inside a
    function too; helper modules and the module itself are not."""
    text = ("import tests.test_a\nfrom tests.test_b import x\nfrom tests import test_c, live\n"
            "def f():\n    from .test_d import y\n    from . import test_e\n"
            "from tests.live import live_daphne\nfrom tests.test_self import z\n")
    assert imported_test_modules("tests.test_self", text) == [
        "tests.test_a", "tests.test_b", "tests.test_c", "tests.test_d", "tests.test_e"]


# --- services return data; shared helpers live in core (issue 39) ------------------------

HTTP_MODULES = ("django.http", "rest_framework.response")
# Moved from tasks_app to core (``core.idempotency``, ``core.deadlocks``, ``core.wire``,
# ``core.actors``): no app imports them from tasks_app, and tasks_app defines none of them.
MOVED_TO_CORE = {
    "parse_idempotency_key", "body_digest", "respond_once", "run_once", "StoredResponse", "retry_on_deadlock",
    "iso", "actor_owner", "actor_machine", "ACTOR_SERVICE", "ACTOR_SWEEP",
}


def imported_names(text: str) -> list[tuple[str, str, int]]:
    """Every ``(module, name, line)`` that ``text`` imports or reads as an attribute of an
    imported module: ``from m import n`` gives ``(m, n)``; ``import m`` / ``import m as a`` /
    ``from p import m`` followed by ``a.n`` gives ``(m, n)``; ``import m`` alone gives
    ``(m, "")``. Relative imports are left out (the project uses none)."""
    found: list[tuple[str, str, int]] = []
    modules: dict[str, str] = {}  # local name -> module it stands for
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, "", node.lineno))
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:  # ``import a.b`` binds ``a``
                    modules[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                found.append((node.module, alias.name, node.lineno))
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                dotted = ".".join([modules[value.id], *parts])
                module, _, name = dotted.rpartition(".")
                found.append((module, name, node.lineno))
    return found


def _is_service(name: str) -> bool:
    """A service module: in a ``services`` package or named ``services``."""
    return "services" in name.split(".")


def http_in_services(sources: dict[str, tuple[str, bool]]) -> list[str]:
    return sorted(
        f"{module}:{line} imports {(imported + '.' + name).strip('.')}"
        for module, (text, _) in sources.items() if _is_service(module)
        for imported, name, line in imported_names(text)
        if any(f"{imported}.{name}".strip(".") == m or f"{imported}.{name}".startswith(m + ".")
               or imported == m or imported.startswith(m + ".") for m in HTTP_MODULES)
    )


def shared_helpers_from_tasks_app(sources: dict[str, tuple[str, bool]]) -> list[str]:
    imports = sorted(
        f"{module}:{line} takes {name} from {imported}"
        for module, (text, _) in sources.items() if not _in("tasks_app")(module)
        for imported, name, line in imported_names(text)
        if _in("tasks_app")(imported) and name in MOVED_TO_CORE
    )
    definitions = sorted(
        f"{module}:{node.lineno} defines {target}"
        for module, (text, _) in sources.items() if _in("tasks_app")(module)
        for node in ast.parse(text).body
        for target in (
            [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            else [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign)
            else []
        )
        if target in MOVED_TO_CORE
    )
    return imports + definitions


SOURCES = project_sources()


def test_services_speak_no_http():
    """Services return data, ``(status, body, ties)`` or a domain object; the views
    answer through ``core.idempotency.respond_once`` or DRF. No service module imports
    ``django.http`` or ``rest_framework.response`` (STYLE 19)."""
    assert http_in_services(SOURCES) == []


def test_no_app_takes_the_shared_helpers_from_tasks_app():
    """The idempotency machinery, ``retry_on_deadlock``, ``iso`` and the actor strings
    live in ``core``: no other app imports them from tasks_app, and tasks_app defines
    none of them again."""
    assert shared_helpers_from_tasks_app(SOURCES) == []
    assert {"core.idempotency", "core.deadlocks", "core.actors", "core.wire"} <= set(SOURCES)


def test_http_and_helper_guards_see_every_form():
    """The guards can fail: each way in is reported."""
    sources = {
        "tasks_app.services.a": ("from django.http import HttpResponse\n", False),
        "tasks_app.services.b": ("def f():\n    from rest_framework.response import Response\n", False),
        "tasks_app.services.c": ("from django import http\n", False),
        "notifications.services": ("import rest_framework.response as r\n", False),
        "tasks_app.api.views": ("from django.http import HttpResponse\n", False),
        "sessions_app.shapes": ("from tasks_app.shapes import iso, task_dict\n", False),
        "board.x": ("from tasks_app.services import locking\nlocking.retry_on_deadlock\n", False),
        "sessions_app.y": ("import tasks_app.shapes\ntasks_app.shapes.actor_owner(None)\n", False),
        "tasks_app.shapes": ("def iso(value):\n    return value\n", False),
        "tasks_app.services.z": ("from core.actors import actor_owner\n", False),
    }
    assert http_in_services(sources) == [
        "notifications.services:1 imports rest_framework.response",
        "tasks_app.services.a:1 imports django.http.HttpResponse",
        "tasks_app.services.b:2 imports rest_framework.response.Response",
        "tasks_app.services.c:1 imports django.http",
    ]
    assert shared_helpers_from_tasks_app(sources) == [
        "board.x:2 takes retry_on_deadlock from tasks_app.services.locking",
        "sessions_app.shapes:1 takes iso from tasks_app.shapes",
        "sessions_app.y:2 takes actor_owner from tasks_app.shapes",
        "tasks_app.shapes:1 defines iso",
    ]


def test_the_task_seam_calls_exactly_the_listed_receivers():
    """``sessions_app/receivers.py`` is the one list of who hears the task core: each
    signal of ``tasks_app/signals.py`` calls exactly its ``RECEIVERS``, in their order."""
    from sessions_app.receivers import RECEIVERS
    from tasks_app import signals
    from tasks_app.models import Task

    for signal in (signals.task_changed, signals.task_session_claimed):
        sync, asynchronous = signal._live_receivers(Task)
        assert (sync, asynchronous) == ([r for s, r, _ in RECEIVERS if s is signal], [])
