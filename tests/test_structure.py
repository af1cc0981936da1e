"""The house rules of src/ that a refactor must not undo (issue: explicit seams, one commit path)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dflashkit"
FILES = sorted(SRC.rglob("*.py"))


def functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_modules_functions_and_lines_stay_small():
    problems = []
    for f in FILES:
        text = f.read_text()
        lines = text.splitlines()
        if len(lines) > 450:
            problems.append(f"{f.relative_to(SRC)}: {len(lines)} lines (> 450)")
        problems += [f"{f.relative_to(SRC)}:{i + 1}: {len(l)} characters (> 120)" for i, l in enumerate(lines)
                     if len(l) > 120]
        for fn in functions(ast.parse(text)):
            n = fn.end_lineno - fn.lineno + 1
            if n > 80:
                problems.append(f"{f.relative_to(SRC)}:{fn.lineno}: {fn.name} has {n} lines (> 80)")
    assert not problems, "\n".join(problems)


def attribute_uses(name: str, on: tuple[str, ...] | None = None):
    """(file, line) of every `<expr>.<name>` in src/ (only where <expr> ends in a name containing one of `on`)."""
    for f in FILES:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == name:
                base = node.value
                owner = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                if on is None or any(x in owner for x in on):
                    yield f.relative_to(SRC).as_posix(), node.lineno


def test_only_the_hf_backend_touches_the_wrapped_model():
    # `<target>.model` and a cache's private fields belong to the backend; others go through TargetModel.
    assert {f for f, _ in attribute_uses("model", on=("target", "tgt", "self", "eng"))} <= {"backends/hf.py"}
    assert not [u for u in attribute_uses("_write_pos")] and not [u for u in attribute_uses("_kv_len")]


def test_one_rollback_site():
    # Moving an accepted path to slot == position and advancing `start` happen in DecodeBatch._commit only.
    moves = list(attribute_uses("move"))
    assert [f for f, _ in moves] == ["batch.py"]
    tree = ast.parse((SRC / "batch.py").read_text())
    commit = next(fn for fn in functions(tree) if fn.name == "_commit")
    assert commit.lineno <= moves[0][1] <= commit.end_lineno
    writers = [fn.name for fn in functions(tree) for node in ast.walk(fn)
               if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "start"
                                                       for t in node.targets)]
    assert set(writers) <= {"_commit", "_join", "_compact", "__init__"}  # advance only in _commit


def test_the_api_cli_and_bench_share_one_default():
    import argparse

    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.bench import BenchConfig
    from dflashkit.cli import build_parser, decode_config
    import inspect

    rec = DecodeConfig.recommended()
    for cmd in (["generate", "--prompt", "x"], ["serve"], ["bench", "--dataset", "humaneval"]):
        args = build_parser().parse_args(cmd)
        assert isinstance(args, argparse.Namespace) and decode_config(args).replace(block_size=None) == rec, cmd
    assert BenchConfig(datasets=[]).decode == rec
    assert "DecodeConfig.recommended()" in inspect.getsource(DFlashEngine.__init__)


def module_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, at the top or inside a function."""
    names = {}
    for f in FILES:
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in names.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg
                    for _ in range(node.level - 1):
                        up = up.rsplit(".", 1)[0]
                    base = up + ("." + node.module if node.module else "")
                for a in node.names:  # `from . import x` names a module; `from .m import f` names m
                    found.add(base + "." + a.name if base + "." + a.name in names else base)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_no_import_circles():
    """No module imports, directly or through others, a module that imports it (imports inside functions
    count: they hide a circle, they do not remove it)."""
    graph = module_imports()
    assert "dflashkit.kernels" in graph and graph["dflashkit.cli"]  # the walk sees the package

    def reaches(a, b, seen):
        return any(n == b or (n not in seen and not seen.add(n) and reaches(n, b, seen)) for n in graph[a])
    circles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a, set()))
    assert not circles, "\n".join(circles)


def test_the_batch_calls_the_policy_through_three_calls_only():
    """The step policy's seam (`policy/step.py`): DecodeBatch asks `plan`, `cut` and `observe`, hands it a
    StepView / StepOutcome (never itself), and the policy's modules never import the batch."""
    tree = ast.parse((SRC / "batch.py").read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "policy"}
    assert used == {"plan", "cut", "observe"}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in used:
            assert not any(isinstance(a, ast.Name) and a.id == "self" for a in call.args), ast.unparse(call)
    graph = module_imports()
    assert not any("dflashkit.batch" in graph[m] for m in graph if m.startswith("dflashkit.policy"))
