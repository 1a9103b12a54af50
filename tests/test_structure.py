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
  side, and the service side imports only ``machine.protocol`` from it, except the thin
  commands that start the worker, pair it or install the hooks, and the hooks' old entry
  point (``sessions_app/hooks/__main__.py``, kept for entries older installs wrote);
- ``machine.protocol`` (the contract's numbers, shapes and R4's ``Backoff``) imports only the
  standard library, so the worker, the hooks and the service share it;
- the agent hooks (``machine/hooks/``) import, of the project, only themselves and
  ``machine.protocol`` (a hook starts in milliseconds, I1).
"""
import ast
import sys
from pathlib import Path

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
    assert sorted(shapes) == ["board.shapes", "notifications.shapes", "sessions_app.shapes", "tasks_app.shapes"]
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
    knows ``machine`` by its protocol module alone."""
    machine = _in("machine")
    assert offending(lambda name: not machine(name) and name not in MACHINE_STARTERS,
                     lambda target: machine(target) and target != "machine.protocol") == []


def test_machine_imports_no_framework_and_no_app():
    """``machine`` could ship alone: no Django, DRF, Channels, and no service module."""
    machine = _in("machine")
    assert offending(machine, lambda target: not machine(target)) == []
    assert {name: sorted(EXTERNAL[name] & set(FRAMEWORKS)) for name in EXTERNAL if machine(name)} == {
        name: [] for name in EXTERNAL if machine(name)
    }
    assert EXTERNAL["machine.protocol"] - sys.stdlib_module_names == set()
    assert offending(lambda name: name == "machine.protocol", lambda target: True) == []


# What the worker and the hooks share (issue 39): the outbox and its sender, the atomic
# write and the settings reader, each loading only the standard library's ``os``.
MACHINE_SHARED = {"machine", "machine.protocol", "machine.outbox", "machine.files", "machine.settings"}


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
