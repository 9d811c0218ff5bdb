"""scaletune: fine-tune large language models with one YAML file, from one CPU to many GPUs."""

import functools

__version__ = "0.1.0"


@functools.cache  # git is asked once per process
def version_string() -> str:
    """`0.1.0`, with the git commit when scaletune runs from a checkout (an editable install):
    `0.1.0 (git 1a2b3c4, modified)`. Shown by `scaletune --version`, `doctor` and every run's
    config.yaml."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return __version__
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git on this machine
        return __version__
    if not commit:
        return __version__
    return f"{__version__} (git {commit}{', modified' if dirty else ''})"
