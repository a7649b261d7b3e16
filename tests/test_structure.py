"""The generated project's structure, for every task: the machinery (ddp_utils) imports no file
of the user's, by any import (function-local ones too), and no module imports itself back
through others (no import cycles); the files at the root say whose they are."""

import ast

import pytest
from conftest import TASKS, bake_ok


def modules_of(project):
    """{dotted module name: path} of the project's Python files, its tests apart."""
    modules = {}
    for path in sorted(project.rglob("*.py")):
        parts = path.relative_to(project).with_suffix("").parts
        if parts[0] == "tests":
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(project):
    """{module: the project's modules it imports}, from every import statement in its file."""
    modules = modules_of(project)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".") if package else []
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # the longest prefix that is a module here
                    target = target.rpartition(".")[0]
                if target and target != name:
                    imported.add(target)
        graph[name] = imported
    return graph


def cycle_in(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return [*path[path.index(other) :], other]
            if other not in state:
                found = visit(other, [*path, other])
                if found:
                    return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


@pytest.fixture(scope="module", params=TASKS)
def project(request, cookies_session):
    return bake_ok(cookies_session, task=request.param, project_name=f"Structure {request.param}")


def test_the_machinery_imports_no_user_file_and_nothing_imports_back(project):
    graph = import_graph(project)
    assert "ddp_utils.trainer" in graph and "task" in graph  # the graph sees the package and the root
    for name, imported in graph.items():
        if name.split(".")[0] == "ddp_utils":
            outside = sorted(other for other in imported if other.split(".")[0] != "ddp_utils")
            assert not outside, f"{name} imports the user's {outside}"
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph))


def test_the_checker_sees_a_cycle_and_a_user_import(tmp_path):
    """The two properties above can fail: a planted cycle and a machinery module importing model."""
    (tmp_path / "ddp_utils").mkdir()
    (tmp_path / "ddp_utils" / "__init__.py").write_text("")
    (tmp_path / "ddp_utils" / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "ddp_utils" / "b.py").write_text("from ddp_utils import a\n\n\ndef g():\n    import model\n")
    (tmp_path / "model.py").write_text("")
    graph = import_graph(tmp_path)
    assert graph["ddp_utils.b"] == {"ddp_utils", "ddp_utils.a", "model"}  # the package too: its __init__ runs
    assert cycle_in(graph) == ["ddp_utils.a", "ddp_utils.b", "ddp_utils.a"]


def test_each_root_file_says_whose_it_is(project):
    """A root Python file's docstring opens by saying it is the user's ("Yours") or, for an
    entry point that is machinery, names the ddp_utils module that holds the code."""
    for path in sorted(project.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert doc.startswith("Yours") or ("Machinery:" in doc and "ddp_utils/" in doc), f"{path.name}: {doc[:120]!r}"
        if not doc.startswith("Yours"):
            assert len(path.read_text().splitlines()) <= 30, f"{path.name} is an entry point: thin"


def test_the_package_map_lists_every_module_above_what_it_imports(project):
    """ddp_utils/__init__.py's map: every module once, each importing only modules below it."""
    doc = ast.get_docstring(ast.parse((project / "ddp_utils" / "__init__.py").read_text()))
    listed = [line.split()[0][: -len(".py")] for line in doc.splitlines() if line.split()[:1] and
              line.split()[0].endswith(".py") and line.startswith("    ")]  # fmt: skip
    modules = sorted(p.stem for p in (project / "ddp_utils").glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == modules
    graph = import_graph(project)
    for position, name in enumerate(listed):
        above = {f"ddp_utils.{other}" for other in listed[: position + 1]}
        assert not graph[f"ddp_utils.{name}"] & above, f"{name} imports {graph[f'ddp_utils.{name}'] & above}"
