"""The direction of dependencies (README "Layout", issue 10), checked on the source.

Every ``.py`` of ``config/``, ``tasks_app/`` and ``sessions_app/`` is parsed with ``ast``;
imports at module level and inside functions alike become edges of one module graph. The
rules:

- no cycle between modules;
- ``tasks_app`` imports nothing from ``sessions_app`` (sessions sit on top of the task
  core and meet it through ``tasks_app/signals.py``);
- services import no ``api`` module; the wire shapes import no DRF;
- low-level ``config/`` modules import no app; only the composition layer
  (``config/urls.py``, ``asgi.py``, ``server_hooks.py``) sees both apps;
- the worker (``tasks_app/worker/``) imports no Django and, of the service side, only
  ``tasks_app.protocol``.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("config", "tasks_app", "sessions_app")
COMPOSITION = {"config.urls", "config.asgi", "config.server_hooks"}
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


def test_tasks_app_imports_nothing_from_sessions_app():
    assert offending(_in("tasks_app"), _in("sessions_app")) == []


def test_services_import_no_api_module():
    def is_service(name: str) -> bool:
        return ".services" in f".{name}" and name.split(".")[-1] != "api"

    def is_api(name: str) -> bool:
        return "api" in name.split(".")

    assert offending(is_service, is_api) == []


def test_wire_shapes_import_no_drf():
    shapes = [name for name in EXTERNAL if name.split(".")[-1] == "shapes"]
    assert sorted(shapes) == ["sessions_app.shapes", "tasks_app.shapes"]
    assert {name: sorted(EXTERNAL[name] & {"rest_framework", "drf_spectacular"}) for name in shapes} == {
        name: [] for name in shapes
    }
    assert offending(lambda name: name in shapes, lambda target: "api" in target.split(".")) == []


def test_low_level_config_imports_no_app():
    def low_level(name: str) -> bool:
        return _in("config")(name) and name not in COMPOSITION

    assert offending(low_level, lambda target: not _in("config")(target)) == []


def test_worker_imports_no_django():
    worker = _in("tasks_app.worker")
    assert offending(worker, lambda target: not worker(target) and target not in {"tasks_app", "tasks_app.protocol"}) == []
    assert {name: sorted(EXTERNAL[name] & set(FRAMEWORKS)) for name in EXTERNAL if worker(name)} == {
        name: [] for name in EXTERNAL if worker(name)
    }
    assert EXTERNAL["tasks_app.protocol"] == set()
