"""The package's shape: no import circles between its modules.

Read from the source with `ast`, not by importing: every `import dlrm_hybrid...` and
`from dlrm_hybrid... import ...` (relative ones too), wherever it stands (module level, inside a
function, under `if TYPE_CHECKING`). `from package import name` counts as importing the module
`package.name` where that is one. A circle means none of its modules can be read, tested or
changed alone.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = "dlrm_hybrid"
ROOT = Path(__file__).resolve().parent.parent

def module_files(root: Path = ROOT) -> Dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The package's modules that module `name` (at `path`) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 folders
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    modules = module_files(root)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return sorted(found)


def cycle_in(component: List[str], graph: Dict[str, Set[str]]) -> List[str]:
    """One circle through the component's first module, as the path of imports it takes."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for step in sorted(graph[node] & members):
            if step == start:
                return paths[node] + [start]
            if step not in paths:
                paths[step] = paths[node] + [step]
                queue.append(step)
    return component


def describe(component: List[str], graph: Dict[str, Set[str]]) -> str:
    return " -> ".join(cycle_in(component, graph)) + f"  (all of: {', '.join(component)})"


def test_the_import_graph_is_read():
    graph = import_graph()
    assert "dlrm_hybrid.config" in graph["dlrm_hybrid.parallel.cost_model"]
    assert "dlrm_hybrid.errors" in graph["dlrm_hybrid.config"]


def test_no_import_circles():
    graph = import_graph()
    problems = [f"import circle: {describe(c, graph)}" for c in circles(graph)]
    assert not problems, "\n".join(problems)


def test_circles_are_found(tmp_path):
    """The finder itself: a circle through a function-level and a relative import is caught."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from dlrm_hybrid.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "sub" / "c.py").write_text("import dlrm_hybrid.a\n")
    (package / "lone.py").write_text("from dlrm_hybrid import a\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["dlrm_hybrid.a", "dlrm_hybrid.sub.b", "dlrm_hybrid.sub.c"]]
    assert cycle_in(circles(graph)[0], graph) == [
        "dlrm_hybrid.a", "dlrm_hybrid.sub.b", "dlrm_hybrid.sub.c", "dlrm_hybrid.a"]


def test_loading_and_checking_a_config_imports_no_torch():
    """Configs are checked before torch is imported (preflight, torchrun): the schema, the
    checks and the loading stay torch-free."""
    script = ("import sys\nfrom dlrm_hybrid.config_loading import load_config\n"
              "load_config('configs/criteo_1tb_fl15.yaml', ['parallel.device=a100'], world_size=8)\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchrec')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_module_imports_torchmetrics():
    """Its import (every metric it has, and matplotlib) cost ~1 s of CPU, ~15% of the start of
    every process that trains or evaluates; the AUC is train/evaluate.py's own."""
    for name, path in module_files().items():
        tree = ast.parse(path.read_text(), str(path))
        tops = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
        tops |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
        assert "torchmetrics" not in tops, f"{name} imports torchmetrics"


MAX_LINES = 450


def test_no_module_is_a_700_line_room():
    """One concept per module: past MAX_LINES a module holds several and should be split."""
    long = {name: n for name, path in module_files().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def layout_sections(page: str) -> Dict[str, Set[str]]:
    """docs/layout.md's module names by folder ("" for the top level): each section lists the
    modules of the folders its heading names, as `name.py` or `folder/name.py`."""
    found: Dict[str, Set[str]] = {}
    for part in re.split(r"\n#{2,3} ", page)[1:]:
        heading, _, body = part.partition("\n")
        folders = [f.rstrip("/") for f in re.findall(r"`([\w/]+/)`", heading)] or [""]
        for name in re.findall(r"`([\w/]+\.py)`", body):
            folder, _, module = name.rpartition("/")
            for owner in ([folder] if folder else folders):
                found.setdefault(owner, set()).add(module)
    return found


def test_docs_layout_names_every_module():
    """docs/layout.md is the map a newcomer reads: every module of the tree is on it, in its
    folder's section, and every module on it is in the tree."""
    listed = layout_sections((ROOT / "docs" / "layout.md").read_text())
    tree: Dict[str, Set[str]] = {}
    for name, path in module_files().items():
        if path.name != "__init__.py":
            tree.setdefault("/".join(name.split(".")[1:-1]), set()).add(path.name)
    unnamed = {f: sorted(m - listed.get(f, set())) for f, m in tree.items() if m - listed.get(f, set())}
    gone = {f: sorted(m - tree.get(f, set())) for f, m in listed.items() if m - tree.get(f, set())}
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"
    assert not gone, f"docs/layout.md names modules that are not there: {gone}"
