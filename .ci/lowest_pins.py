"""Print `name==lower-bound` for every dependency of pyproject.toml (runtime and `dev`), for
`make test-lowest`: the suite run with each dependency at the lowest version we declare -- torch
included (its floor comes from PyPI as its CUDA build, several GB, which runs on a CPU too)."""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml").read_text())["project"]
for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
    match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", req)
    if match is None:
        raise SystemExit(f"pyproject.toml: {req!r} has no `>=` lower bound; give it one so `make test-lowest` can test it.")
    print(f"{match.group(1)}=={match.group(3)}")
