"""Build ``examples/workloads/release_edits.jsonl``: the functions that changed a little between releases of a
package, each as its old and new source (the predicted-outputs workload, ``examples/predicted_outputs.py``).

The shipped file comes from ``packaging`` (https://pypi.org/project/packaging/, Apache-2.0 OR BSD-2-Clause,
(c) Donald Stufft and individual contributors) 24.0, 24.1, 24.2 and 25.0, fetched and unpacked with::

    pip download --no-deps packaging==24.0 packaging==24.1 packaging==24.2 packaging==25.0 -d wheels
    for w in wheels/*.whl; do v=$(basename $w | cut -d- -f2); mkdir -p src/$v; python -m zipfile -e $w src/$v; done
    python examples/build_release_edits.py packaging src/24.0 src/24.1 src/24.2 src/25.0

A function qualifies when its source changed between two consecutive releases but stayed similar (difflib ratio
0.8 to 0.995: an edit, not a rewrite) and is 300 to 1500 characters long in both.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "workloads" / "release_edits.jsonl"


def functions(root: Path, package: str) -> dict[tuple[str, str], str]:
    """Every function and method of ``package`` under ``root``: (file, qualified name) -> its source."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        text = path.read_text()

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    if not isinstance(child, ast.ClassDef):
                        found[str(path.relative_to(root)), name] = ast.get_source_segment(text, child, padded=True)
                    walk(child, name + ".")

        walk(ast.parse(text), "")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package")
    parser.add_argument(
        "releases", nargs="+", type=Path, help="unpacked releases, oldest first (folders named by version)"
    )
    args = parser.parse_args()
    rows = []
    for old_root, new_root in zip(args.releases, args.releases[1:]):
        old, new = functions(old_root, args.package), functions(new_root, args.package)
        for key in sorted(set(old) & set(new)):
            before, after = old[key], new[key]
            similar = difflib.SequenceMatcher(None, before, after).ratio()
            if before != after and 0.8 <= similar < 0.995 and all(300 <= len(s) <= 1500 for s in (before, after)):
                rows.append(
                    {
                        "id": f"{args.package} {old_root.name}->{new_root.name} {key[0]}:{key[1]}",
                        "old": before,
                        "new": after,
                    }
                )
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} functions -> {OUTPUT}")


if __name__ == "__main__":
    main()
