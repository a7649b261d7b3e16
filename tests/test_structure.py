"""The generated project's structure, for every task: the machinery (ddp_utils) imports no file
of the user's, by any import (function-local ones too), and no module imports itself back
through others (no import cycles); the files at the root say whose they are."""

import ast
import re

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
    assert "ddp_utils.train.trainer" in graph and "task" in graph  # the graph sees the package and the root
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


def part_of(module):
    """The part of ddp_utils a module belongs to: its folder (`ddp_utils.train`) or, at the top,
    the module itself (`ddp_utils.knobs`); None outside the package or for the package itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "ddp_utils" and len(parts) > 1 else None


def parts_graph(graph):
    """{part: the other parts its modules import}: the import direction between folders."""
    parts = {}
    for name, imported in graph.items():
        if part_of(name):
            own = parts.setdefault(part_of(name), set())
            own |= {part_of(other) for other in imported if part_of(other) and part_of(other) != part_of(name)}
    return parts


def listed_in(init):
    """The names an __init__.py's docstring map lists: lines that open with a module (`x.py`)
    or a folder (`x/`) and two spaces or more before what it does; without the suffix."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    return [m.group(1) for m in re.finditer(r"(?m)^\s*(\w+)(?:\.py|/)  +\S", doc)]


def upward_imports(listed, parts):
    """Each part listed (top floor first) imports only parts listed below it: the violations."""
    return [f"{name} imports {sorted(parts.get(f'ddp_utils.{name}', set()) & {f'ddp_utils.{o}' for o in listed[: i + 1]})}"
            for i, name in enumerate(listed)
            if parts.get(f"ddp_utils.{name}", set()) & {f"ddp_utils.{o}" for o in listed[: i + 1]}]  # fmt: skip


def test_the_package_map_lists_every_folder_above_what_it_imports(project):
    """ddp_utils/__init__.py's map: one line per folder or top-level module, floor by floor, each
    importing only the parts below it; each folder's __init__.py lists its own modules."""
    package = project / "ddp_utils"
    listed = listed_in(package / "__init__.py")
    actual = sorted([p.stem for p in package.glob("*.py") if p.stem != "__init__"] +
                    [p.parent.name for p in package.glob("*/__init__.py")])  # fmt: skip
    assert sorted(listed) == actual
    assert len([p for p in package.glob("*/__init__.py")]) >= 8, "the machinery is in folders by concern"
    for init in sorted(package.glob("*/__init__.py")):
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        assert sorted(listed_in(init)) == modules, f"{init.parent.name}/__init__.py lists {listed_in(init)}"
        assert not list(init.parent.glob("*/__init__.py")), f"{init.parent.name}/ has folders of its own: one floor"
    problems = upward_imports(listed, parts_graph(import_graph(project)))
    assert not problems, problems


def test_the_folder_checker_sees_an_import_back_up(tmp_path):
    """A module of a lower folder importing a higher one is named, so the rule above can fail."""
    for folder in ("low", "high"):
        (tmp_path / "ddp_utils" / folder).mkdir(parents=True)
        (tmp_path / "ddp_utils" / folder / "__init__.py").write_text("")
    (tmp_path / "ddp_utils" / "__init__.py").write_text('"""Map.\n\n    high/  above\n    low/   below\n"""\n')
    (tmp_path / "ddp_utils" / "high" / "a.py").write_text("from ..low import b\n")
    (tmp_path / "ddp_utils" / "low" / "b.py").write_text("x = 1\n")
    listed = listed_in(tmp_path / "ddp_utils" / "__init__.py")
    assert listed == ["high", "low"]
    assert upward_imports(listed, parts_graph(import_graph(tmp_path))) == []
    (tmp_path / "ddp_utils" / "low" / "b.py").write_text("def f():\n    from ..high.a import g\n")
    assert upward_imports(listed, parts_graph(import_graph(tmp_path))) == ["low imports ['ddp_utils.high']"]
