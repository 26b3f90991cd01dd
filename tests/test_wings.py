"""The wings' rules (issue 26), read from the code with ast: every import of every module of the distribution,
function-level ones too (a function-level import is still a dependency: it only moves a failure to run time).

- onespark/model/: the standard library only (and onespark's small shared modules, themselves standard library).
- onespark/checkpoint/: never torch or vllm (nor kernels/ or patches/, which bring them): surgery moves bytes.
- onespark/serving/: the standard library at module level, also through the onespark modules it imports there
  (`install.sh --dry-run` runs serve before any virtualenv exists); never patches/ or kernels/.
- bench/ (the shipped benchmark): never kernels/ or patches/.
- Product and lab apart (issue 56): no module of the distribution imports a lab module (lab/*.py, run as sibling
  modules), and no test does outside the lab's tooling (tests/lab/, and tests/gpu_vllm/, the GPU lane that drives
  lab scripts, to move to lab/); no sys.path edit in the distribution at all, nor one in a product test that
  reaches lab/ (the lab's own tests put lab/ on sys.path as the lab scripts run).
- No import circle among the distribution's modules; no module imports another module's `_`-prefixed name, and
  a `_`-prefixed module is imported only from inside its own package.
- Namespaces stop at the edge: no `getattr(args, ...)` outside a command's run() (or the from_args it calls).

A tiny tree with a forbidden import of each kind, written to tmp_path, shows the checker reports each one.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The distribution: package -> its directory (pyproject's package-dir mapping).
PACKAGES = {"onespark": ROOT / "onespark", "onespark.kernels": ROOT / "kernels", "onespark.patches": ROOT / "patches",
            "onespark.bench": ROOT / "bench"}
# The top-level modules every wing may use: small, standard library only (checked below like a wing).
LAB = ROOT / "lab"
SHARED = ("onespark", "onespark.errors", "onespark.options", "onespark.shape", "onespark.tracks")
STDLIB = sys.stdlib_module_names | {"__future__"}


@dataclass(frozen=True)
class Import:
    importer: str  # the module whose code holds the import
    target: str  # the module imported (for `from M import n`: M.n when that is a module, else M)
    name: str  # for `from M import n`: n; else ""
    top: bool  # at module level (not inside a function)
    where: str  # path:line, for the message

    @property
    def root(self) -> str:
        return self.target.partition(".")[0]


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module of the distribution -> its file (an __init__.py stands for its package)."""
    found = {}
    for pkg, top in packages.items():
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((pkg, *parts))] = path
    return found


def walk(node: ast.AST, top: bool = True):
    """Each node below `node` with whether it runs at module level (not inside a function)."""
    for child in ast.iter_child_nodes(node):
        yield child, top
        yield from walk(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def imports(mods: dict[str, Path], root: Path) -> list[Import]:
    out: list[Import] = []
    for me, path in mods.items():
        where = path.relative_to(root)
        for node, top in walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [Import(me, a.name, "", top, f"{where}:{node.lineno}") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package, one level up per dot past the first
                    pkg = (me if path.name == "__init__.py" else me.rpartition(".")[0]).split(".")
                    base = ".".join([*pkg[:len(pkg) - node.level + 1], *([base] if base else [])])
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append(Import(me, sub if sub in mods else base, a.name, top, f"{where}:{node.lineno}"))
    return out


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def wing_problems(found: list[Import], mods: dict[str, Path]) -> list[str]:
    problems = []

    def bad(i: Import, rule: str) -> None:
        problems.append(f"{i.where}: {i.importer} imports {i.target}: {rule}")

    for i in found:
        stdlib = i.root in STDLIB
        if in_package(i.importer, "onespark.model") or i.importer in SHARED:
            if not (stdlib or in_package(i.target, "onespark.model") or i.target in SHARED):
                bad(i, "model/ and the shared modules use the standard library only")
        if in_package(i.importer, "onespark.checkpoint"):
            if i.root in ("torch", "vllm", "triton") or in_package(i.target, "onespark.kernels") \
                    or in_package(i.target, "onespark.patches"):
                bad(i, "checkpoint/ never imports torch or vllm")
        if in_package(i.importer, "onespark.serving") or in_package(i.importer, "onespark.bench"):
            if in_package(i.target, "onespark.patches") or in_package(i.target, "onespark.kernels"):
                bad(i, "serving/ and bench/ never import patches/ or kernels/")
    # serving/ at module level: the standard library, also through what it imports from onespark there
    top = {}
    for i in found:
        if i.top:
            top.setdefault(i.importer, []).append(i)
    reported = set()
    for start in sorted(m for m in mods if in_package(m, "onespark.serving")):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            for i in top.get(m, ()):
                if i.target in mods:
                    todo.append(i.target)
                elif i.root not in STDLIB and i not in reported:
                    reported.add(i)
                    bad(i, f"serving/ is standard library at module level (reached from {start})")
    # private names and modules, of the distribution's own code
    for i in found:
        if not in_package(i.target, "onespark"):
            continue
        private_name = i.name.startswith("_") and not i.name.endswith("__")  # __version__ is public
        if private_name and i.target != f"{i.importer}" and not i.target.endswith("." + i.name):  # a module: below
            bad(i, f"imports the private name {i.name}")
        parts = i.target.split(".")
        for k, part in enumerate(parts):
            if part.startswith("_") and not part.endswith("__"):  # __future__, __main__ are public
                owner = ".".join(parts[:k])
                if not in_package(i.importer, owner):
                    bad(i, f"{part} is private to {owner}")
                break
    return sorted(set(problems))


def graph_of(found: list[Import], mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for i in found:
        if i.target in mods and i.target != i.importer:
            graph[i.importer].add(i.target)
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d] if d in path else [m, d, m]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_wings_keep_their_rules():
    mods = modules(PACKAGES)
    found = imports(mods, ROOT)
    # the tree is read at all: each wing, and the imports the rules are about
    assert {"onespark.model.specs", "onespark.checkpoint.writer", "onespark.serving.serve", "onespark.bench.cli",
            "onespark.patches._compat", "onespark.kernels"} <= set(mods)
    assert any(i.importer == "onespark.serving.serve" and i.target == "onespark.serving.launch" for i in found)
    assert wing_problems(found, mods) == []


def test_onespark_modules_have_no_import_circle():
    mods = modules(PACKAGES)
    graph = graph_of(imports(mods, ROOT), mods)
    assert "onespark.serving.launch" in graph["onespark.serving.serve"]  # the graph is read at all
    assert find_circle(graph) is None, find_circle(graph)


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return {"onespark": tmp_path / "onespark", "onespark.patches": tmp_path / "patches",
            "onespark.bench": tmp_path / "bench"}


def test_the_checker_reports_each_forbidden_import(tmp_path):
    packages = _tree(tmp_path, {
        "onespark/__init__.py": "",
        "onespark/errors.py": "",
        "onespark/model/__init__.py": "",
        "onespark/model/specs.py": "import json\nfrom onespark.errors import x\n\ndef f():\n    import numpy\n",
        "onespark/checkpoint/__init__.py": "",
        "onespark/checkpoint/hybrid.py": "import numpy\n\ndef f():\n    import torch\n",
        "onespark/checkpoint/writer.py": "import httpx\n",  # third party at module level: allowed here...
        "onespark/serving/__init__.py": "",
        "onespark/serving/serve.py": "from onespark.checkpoint import writer\n\ndef f():\n"
                                     "    import httpx\n    from onespark.patches import _compat\n",
        "onespark/serving/launch.py": "from onespark.serving.serve import _http\n",
        "patches/__init__.py": "",
        "patches/_compat.py": "",
        "bench/__init__.py": "",
        "bench/cli.py": "def f():\n    import onespark.patches\n",
    })
    mods = modules(packages)
    found = imports(mods, tmp_path)
    assert wing_problems(found, mods) == [
        "bench/cli.py:2: onespark.bench.cli imports onespark.patches: serving/ and bench/ never import patches/ or "
        "kernels/",
        "onespark/checkpoint/hybrid.py:4: onespark.checkpoint.hybrid imports torch: checkpoint/ never imports torch "
        "or vllm",
        # ...but not for serving/, which reaches it at module level
        "onespark/checkpoint/writer.py:1: onespark.checkpoint.writer imports httpx: serving/ is standard library at "
        "module level (reached from onespark.serving.launch)",
        "onespark/model/specs.py:5: onespark.model.specs imports numpy: model/ and the shared modules use the "
        "standard library only",
        "onespark/serving/launch.py:1: onespark.serving.launch imports onespark.serving.serve: imports the private "
        "name _http",
        "onespark/serving/serve.py:5: onespark.serving.serve imports onespark.patches._compat: _compat is private to "
        "onespark.patches",
        "onespark/serving/serve.py:5: onespark.serving.serve imports onespark.patches._compat: serving/ and bench/ "
        "never import patches/ or kernels/",
    ]


def test_the_circle_check_finds_a_circle(tmp_path):
    packages = _tree(tmp_path, {
        "onespark/__init__.py": "",
        "onespark/a.py": "from onespark import b\n",
        "onespark/b.py": "def f():\n    from onespark.c import g\n    return g\n",  # function-level, still a dep
        "onespark/c.py": "import onespark.a\n\ndef g():\n    from onespark.b import _h\n",
    })
    packages = {"onespark": packages["onespark"]}
    mods = modules(packages)
    found = imports(mods, tmp_path)
    graph = graph_of(found, mods)
    assert graph == {"onespark": set(), "onespark.a": {"onespark.b"}, "onespark.b": {"onespark.c"},
                     "onespark.c": {"onespark.a", "onespark.b"}}
    assert find_circle(graph) == ["onespark.a", "onespark.b", "onespark.c", "onespark.a"]
    assert wing_problems(found, mods) == [
        "onespark/c.py:4: onespark.c imports onespark.b: imports the private name _h"]
    (tmp_path / "onespark/c.py").write_text("def g():\n    pass\n")
    assert find_circle(graph_of(imports(mods, tmp_path), mods)) is None


def args_getattrs(mods: dict[str, Path], root: Path) -> list[str]:
    """`getattr(args, ...)` outside a command's edge (its run(), or a from_args that builds the typed values):
    below the edge, code takes typed values, not a Namespace that may lack the field (issue 26, item 5)."""
    found = []
    for path in mods.values():
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in ("run", "from_args"):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                        and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {fn.name}")
    return sorted(set(found))


def test_namespaces_stop_at_the_edge(tmp_path):
    assert args_getattrs(modules(PACKAGES), ROOT) == []
    packages = _tree(tmp_path, {"onespark/__init__.py": "",
                                "onespark/x.py": "def run(args):\n    return getattr(args, 'a', 1) + f(args)\n\n"
                                                 "def f(args):\n    return getattr(args, 'b', None)\n"})
    assert args_getattrs(modules(packages), tmp_path) == ["onespark/x.py:5: f"]


def test_every_wing_is_a_package_of_the_distribution():
    """The images pip-install onespark (not editable): a wing pyproject does not list would be missing there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    wings = {f"onespark.{d.name}" for d in (ROOT / "onespark").iterdir() if (d / "__init__.py").is_file()}
    assert {"onespark.model", "onespark.checkpoint", "onespark.serving"} <= wings <= listed, wings - listed


# ---- product and lab apart ------------------------------------------------------------------------------------

def lab_modules(lab: Path) -> set[str]:
    """The names a lab module is imported by: lab scripts import each other as sibling modules (`import harness`)."""
    return {"lab", *(p.stem for p in lab.glob("*.py"))}


def sys_path_edits(path: Path, root: Path) -> list[tuple[str, str]]:
    """(path:line, the call's source) of each sys.path.insert/append/extend or assignment to sys.path in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("insert", "append", "extend"):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if target is not None and ast.unparse(target) == "sys.path":
            found.append((f"{path.relative_to(root)}:{node.lineno}", ast.unparse(node)))
    return found


# Folders of tests/ that are lab tooling: tests/lab/ (the lab's own tests) and the GPU vLLM lane, whose benchmarks
# are lab scripts it drives (lab/vllm_step.py, lab/turboquant.py); it belongs in lab/ and is to move there.
LAB_TOOLING = ("tests.lab", "tests.gpu_vllm")


def product_test_files(tests: Path) -> dict[str, Path]:
    """tests/ outside its lab tooling (LAB_TOOLING), as modules."""
    return {m: p for m, p in modules({"tests": tests}).items() if not any(in_package(m, d) for d in LAB_TOOLING)}


def lab_problems(root: Path, packages: dict[str, Path]) -> list[str]:
    lab = lab_modules(root / "lab")
    mods, tests = modules(packages), product_test_files(root / "tests")
    problems = [f"{i.where}: {i.importer} imports {i.target}: product code never imports the lab"
                for i in imports(mods, root) if i.root in lab]
    problems += [f"{i.where}: {i.importer} imports {i.target}: a product test never imports the lab (its tests "
                 "go in tests/lab/)" for i in imports(tests, root) if i.root in lab or in_package(i.target, "tests.lab")]
    problems += [f"{where}: {call}: no sys.path edit in product code" for path in mods.values()
                 for where, call in sys_path_edits(path, root)]
    problems += [f"{where}: {call}: a product test puts the lab on sys.path" for path in tests.values()
                 for where, call in sys_path_edits(path, root) if "lab" in call]
    return sorted(problems)


def test_product_and_lab_stay_apart():
    assert {"harness", "turboquant_swap", "vllm_step"} <= lab_modules(LAB)  # the lab is read at all
    assert "tests.test_turboquant_patch" in product_test_files(ROOT / "tests")
    assert not any(in_package(m, d) for m in product_test_files(ROOT / "tests") for d in LAB_TOOLING)
    assert lab_problems(ROOT, PACKAGES) == []


def test_the_lab_rules_report_each_violation(tmp_path):
    packages = _tree(tmp_path, {
        "onespark/__init__.py": "",
        "onespark/x.py": "import sys\n\nsys.path.insert(0, 'somewhere')\n\ndef f():\n    import harness\n",
        "patches/__init__.py": "",
        "bench/__init__.py": "from onespark import x\n",
        "lab/harness.py": "",
        "lab/turboquant_swap.py": "import harness\n",
        "tests/__init__.py": "",
        "tests/test_a.py": "import sys\nsys.path.insert(0, 'lab')\nimport turboquant_swap\nsys.path.append('data')\n",
        "tests/test_b.py": "from tests.lab.test_c import helper\n",
        "tests/lab/__init__.py": "",
        "tests/lab/test_c.py": "import sys\nsys.path.insert(0, 'lab')\nimport harness\n\ndef helper():\n    pass\n",
        "tests/gpu_vllm/__init__.py": "",
        "tests/gpu_vllm/steps.py": "import sys\nsys.path.insert(0, 'lab')\nimport vllm_step\n",  # lab tooling
    })
    assert lab_problems(tmp_path, packages) == [
        "onespark/x.py:3: sys.path.insert(0, 'somewhere'): no sys.path edit in product code",
        "onespark/x.py:6: onespark.x imports harness: product code never imports the lab",
        "tests/test_a.py:2: sys.path.insert(0, 'lab'): a product test puts the lab on sys.path",
        "tests/test_a.py:3: tests.test_a imports turboquant_swap: a product test never imports the lab (its tests go "
        "in tests/lab/)",
        "tests/test_b.py:1: tests.test_b imports tests.lab.test_c: a product test never imports the lab (its tests go "
        "in tests/lab/)",
    ]
