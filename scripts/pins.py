"""Print the exact pins from pyproject.toml, one per line, for `pip install`.

pyproject.toml is the single list of dependencies; the Makefile installs from it
without installing ferry itself as a package.
"""

import argparse
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--extra", action="append", default=[], help="optional dependency group to add (e.g. test)")
    args = parser.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = list(project["dependencies"])
    for extra in args.extra:
        pins += project["optional-dependencies"][extra]
    print("\n".join(pins))


if __name__ == "__main__":
    main()
