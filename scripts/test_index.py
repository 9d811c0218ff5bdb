"""Print the skeleton of tests/README.md's module -> test index: every module under src/scaletune
with the test files that import it (unit tests first, at most four), read with `ast` (nothing
imported), and those named in BY_HAND. A module no test names gets `TODO`, which
tests/unit/test_test_index.py rejects: add the tests that cover it (an e2e run, say) to BY_HAND.

    python scripts/test_index.py > /tmp/index.md   # then merge into tests/README.md
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
TESTS = REPO / "tests"
TIERS = ["unit", "e2e", "distributed", "security", "serve", "system", "gpu"]


# Modules the tests reach through the command line, a subprocess or a package's entry point rather
# than by importing them: the tests that exercise them, named by hand (listed after the importers).
BY_HAND = {
    "scaletune.checkpoint.resume": ["tests/distributed/test_resume.py", "tests/security/test_hostile_checkpoints.py"],
    "scaletune.checkpoint.gguf": ["tests/e2e/test_export_gguf.py"],
    "scaletune.checkpoint.verify_runtime": ["tests/e2e/test_export_gguf.py", "tests/e2e/test_export_vllm.py"],
    "scaletune.checkpoint.vllm_probe": ["tests/e2e/test_export_vllm.py"],
    "scaletune.resolve.precision": ["tests/unit/test_mixed_precision.py", "tests/unit/test_strategies.py"],
    "scaletune.strategies.param_cast": ["tests/distributed/test_bf16_params.py"],
    "scaletune.strategies.parallel.stages": ["tests/distributed/test_mesh_parity.py"],
    "scaletune.strategies.parallel.mesh": ["tests/distributed/test_mesh_parity.py", "tests/unit/test_mesh.py"],
    "scaletune.strategies.fsdp": ["tests/distributed/test_parity.py", "tests/distributed/test_mesh_parity.py"],
    "scaletune.strategies.parallel.runner": [
        "tests/distributed/test_mesh_parity.py",
        "tests/distributed/test_parity.py",
    ],
    "scaletune.checkpoint.hub": ["tests/e2e/test_push_to_hub.py"],
    "scaletune.cli.config_verbs": ["tests/unit/test_config_docs.py", "tests/e2e/test_launch_configs.py"],
    "scaletune.cli.launch_verbs": ["tests/e2e/test_launch_cli.py"],
    "scaletune.cli.model_verbs": ["tests/e2e/test_model_verbs.py", "tests/e2e/test_cli_usage.py"],
    "scaletune.cli.run_verbs": [
        "tests/e2e/test_train_cli.py",
        "tests/security/test_bad_input.py",
        "tests/e2e/test_export_gguf.py",
    ],
    "scaletune.cli.serve_verbs": ["tests/serve/test_auth_cli.py"],
    "scaletune.cli.remote_verbs": ["tests/serve/test_remote.py"],
    "scaletune.config.yamlfile": ["tests/unit/test_config.py"],
    "scaletune.config.strict": ["tests/unit/test_config.py"],
    "scaletune.trainer.handoff": ["tests/e2e/test_train_cli.py", "tests/distributed/test_resume.py"],
    "scaletune.trainer.objectives": [
        "tests/distributed/test_preference_parity.py",
        "tests/distributed/test_preference_resume.py",
    ],
    "scaletune.data.render": ["tests/unit/test_data.py", "tests/security/test_strangers_files.py"],
    "scaletune.data.render_worker": ["tests/security/test_strangers_files.py"],
    "scaletune.data.factory": ["tests/e2e/test_custom_models.py", "tests/distributed/test_custom_model.py"],
    "scaletune.data.packing": ["tests/unit/test_data.py", "tests/e2e/test_packing.py"],
    "scaletune.data.build": ["tests/distributed/test_data_cache_nodes.py"],
    "scaletune.models.adapters": ["tests/e2e/test_compile.py"],
    "scaletune.doctor.comm": ["tests/distributed/test_doctor_comm.py"],
    "scaletune.doctor.report": ["tests/unit/test_doctor.py"],
    "scaletune.inference.chat": ["tests/unit/test_inference.py", "tests/e2e/test_model_verbs.py"],
    "scaletune.inference.evaluate": ["tests/unit/test_inference.py", "tests/e2e/test_model_verbs.py"],
    "scaletune.inference.samples": ["tests/unit/test_inference.py", "tests/e2e/test_train_cli.py"],
    "scaletune.launch": ["tests/e2e/test_launch_cli.py", "tests/security/test_generated_scripts.py"],
    "scaletune.launch.shell": ["tests/unit/test_launch_commands.py"],
    "scaletune.models.checks": ["tests/unit/test_models.py", "tests/security/test_bad_input.py"],
    "scaletune.plan.report": ["tests/unit/test_plan.py"],
    "scaletune.run.entry": ["tests/e2e/test_train_cli.py"],
    "scaletune.run.reexec": ["tests/distributed/test_parity.py", "tests/e2e/test_train_cli.py"],
    "scaletune.safe_load": ["tests/security/test_hostile_checkpoints.py"],
    "scaletune.serve.api.docs": ["tests/serve/test_openapi.py", "tests/serve/test_mount.py"],
    "scaletune.serve.api.artifacts": ["tests/serve/test_artifacts.py", "tests/serve/test_api.py"],
    "scaletune.serve.api.chat": ["tests/serve/test_page_results.py"],
    "scaletune.serve.api.config": ["tests/serve/test_page_form.py"],
    "scaletune.serve.api.data": ["tests/serve/test_page_data.py"],
    "scaletune.serve.api.jobs": ["tests/serve/test_api.py", "tests/serve/test_deploy.py"],
    "scaletune.serve.api.service": ["tests/serve/test_deploy.py", "tests/serve/test_db.py"],
    "scaletune.serve.api.tasks": ["tests/serve/test_page_results.py"],
    "scaletune.serve.api.teams": ["tests/serve/test_teams.py"],
    "scaletune.serve.edge.access": ["tests/serve/test_teams.py", "tests/security/test_serve_web.py"],
    "scaletune.serve.api.schemas": ["tests/serve/test_openapi.py", "tests/serve/test_deploy.py"],
    "scaletune.serve.jobs.dispatch": ["tests/serve/test_dispatch_local.py", "tests/system/test_serve_slurm.py"],
    "scaletune.serve.jobs.dispatch.base": ["tests/serve/test_dispatch_local.py", "tests/serve/test_api.py"],
    "scaletune.serve.jobs.dispatch.modal": ["tests/serve/test_auth_cli.py"],
    "scaletune.serve.jobs.dispatch.slurm": ["tests/system/test_serve_slurm.py"],
    "scaletune.serve.edge.guard": ["tests/serve/test_api.py", "tests/security/test_serve_policy.py"],
    "scaletune.serve.edge.teams": ["tests/serve/test_teams.py"],
    "scaletune.serve.jobs.records": ["tests/serve/test_api.py", "tests/security/test_serve_restart.py"],
    "scaletune.serve.jobs.states": ["tests/serve/test_api.py", "tests/security/test_serve_restart.py"],
    "scaletune.serve.jobs.submission": ["tests/serve/test_api.py", "tests/security/test_serve_policy.py"],
    "scaletune.serve.jobs.validate": ["tests/serve/test_api.py"],
    "scaletune.serve.page.views": ["tests/serve/test_page_walk.py", "tests/security/test_serve_web.py"],
    "scaletune.serve.jobs.archive": ["tests/serve/test_page_results.py"],
    "scaletune.serve.jobs.chatting": ["tests/serve/test_page_results.py"],
    "scaletune.serve.api.results": ["tests/serve/test_page_results.py"],
    "scaletune.serve.jobs.tasks": ["tests/serve/test_page_results.py"],
    "scaletune.strategies.devices": ["tests/unit/test_strategies.py", "tests/distributed/test_parity.py"],
    "scaletune.strategies.memory": ["tests/distributed/test_memory.py"],
    "scaletune.trainer.stages": ["tests/e2e/test_curriculum.py", "tests/distributed/test_custom_model.py"],
}


def modules() -> list[str]:
    """Every module of scaletune, dotted (`scaletune.trainer.loop`); a package is its `__init__`
    when that defines something (a function, class or assignment), not only re-exports; database
    migration scripts are left out (they are the migrations' data, tested as a whole)."""
    out = []
    for path in sorted((SRC / "scaletune").rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        if "migrations" in rel.parts or rel.name == "__main__":
            continue
        if rel.name == "__init__":
            body = ast.parse(path.read_text()).body
            if not any(isinstance(n, ast.FunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign) for n in body):
                continue
            rel = rel.parent
        out.append(".".join(rel.parts))
    return out


def reexports() -> dict[str, str]:
    """`pkg.name` -> the dotted module a package's `__init__` imports `name` from (`from
    scaletune.pkg.sub import name` or `from .sub import name`)."""
    out: dict[str, str] = {}
    for init in (SRC / "scaletune").rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(SRC).parts)
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or node.level):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                source = ".".join(filter(None, [base, node.module])) if node.level else node.module
                for alias in node.names:
                    out[f"{package}.{alias.asname or alias.name}"] = source
    return out


def imported(test_file: Path, known: set[str], via: dict[str, str]) -> set[str]:
    """The scaletune modules a test file imports anywhere (inside functions too); `from pkg import
    name` counts as importing `pkg.name` where that is a module, or the module `pkg` re-exports
    `name` from (`via`, :func:`reexports`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [via.get(f"{node.module}.{a.name}", f"{node.module}.{a.name}") for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def tier_order(path: str) -> tuple[int, str]:
    tier = path.split("/")[1]
    return (TIERS.index(tier) if tier in TIERS else len(TIERS), path)


def index(limit: int = 4) -> dict[str, list[str]]:
    """module -> the test files (repository-relative) that import it, best first."""
    known, via = set(modules()), reexports()
    users: dict[str, list[str]] = {m: [] for m in known}
    for test_file in sorted(TESTS.rglob("test_*.py")):
        for module in imported(test_file, known, via):
            users[module].append(test_file.relative_to(REPO).as_posix())
    out = {}
    for m in sorted(known):
        best = sorted(users[m], key=tier_order)[:limit]
        out[m] = best + [t for t in BY_HAND.get(m, []) if t not in best]
    return out


def main() -> int:
    print("| module | tests |")
    print("|---|---|")
    for module, tests in index().items():
        print(f"| `{module}` | {', '.join(f'`{t}`' for t in tests) or 'TODO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
