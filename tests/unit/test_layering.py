"""The core imports without grpc or OpenTelemetry (services own transport and telemetry)."""

import subprocess
import sys


def test_core_imports_without_grpc_or_otel():
    code = ("import sys, specserve, specserve.engine.engine, specserve.spec.ddtree, "
            "specserve.drafters.ngram, specserve.drafters.dflash, specserve.probe; "
            "print(sorted(m for m in ('grpc', 'opentelemetry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the import graph: one direction, no cycles ------------------------------------------------
ROOTS = ("specserve", "services")
KNOWN_UP: set[tuple[str, str]] = set()  # none left (the CLI, which talks to the services,
# lives beside them in services/cli; the kernels' references import only what is below them)
KNOWN_CYCLES = []
# the torch references and batch types the kernels implement or take: below the kernels
BELOW_KERNELS = ("specserve.kernels", "specserve.attention.base", "specserve.attention.torch_ref",
                 "specserve.models.rope", "specserve.models.norm")
# (importer prefix, imported prefix): a lower layer never imports a higher one
UPWARD = [("specserve", "services"),
          ("specserve.spec", "specserve.engine"), ("specserve.drafters", "specserve.engine"),
          ("specserve.models", "specserve.engine"), ("specserve.attention", "specserve.engine")]


def _upward(importer: str, imported: str) -> bool:
    if importer.startswith("specserve.kernels") and imported.startswith("specserve."):
        return not imported.startswith(BELOW_KERNELS)
    return any(importer.startswith(lo) and imported.startswith(hi) for lo, hi in UPWARD)


def _module_name(path) -> str:
    parts = list(path.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree, modules: set[str]) -> set[str]:
    """Modules of ours a module imports at run time (not under `if TYPE_CHECKING:`)."""
    import ast

    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return {m for m in out if m in modules}


def _graph() -> dict[str, set[str]]:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = {_module_name(p.relative_to(root)): p for r in ROOTS for p in (root / r).rglob("*.py")
             if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    graph = {}
    for name, path in files.items():
        got = _imports(ast.parse(path.read_text()), set(files))
        graph[name] = {m for m in got if m != name and not name.startswith(m + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def test_imports_run_one_way_and_in_no_circle():
    graph = _graph()
    assert len(graph) > 100 and graph["specserve.engine.engine"]  # the walk saw the code
    up = {(m, t) for m, ts in graph.items() for t in ts if _upward(m, t)}
    assert up - KNOWN_UP == set(), "new imports running up a layer"
    assert KNOWN_UP - up == set(), "a known arrow is gone: drop it from KNOWN_UP"
    assert _cycles(graph) == KNOWN_CYCLES


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_rule_sees_a_kernel_importing_the_model():
    assert _upward("specserve.kernels.fused.ref", "specserve.models.decoder")
    assert not _upward("specserve.kernels.fused.ref", "specserve.models.norm")
    assert _upward("specserve.probe", "services.cli.wire")
    assert not _upward("services.cli.client", "services.common.server")
