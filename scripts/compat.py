"""``make compat``: the declared dependency ranges, installed at both ends and run end to end.

Two fresh virtual environments under ``build/compat/``:

- ``floor``: every dependency of ``pyproject.toml`` (the package's own, the ``hf`` and ``simplify`` extras) at its
  declared lower
  bound (``>=X`` installed as ``==X``); what they pull in resolves as pip resolves it today.
- ``newest``: every dependency at its newest release. pip on some machines reads a constraints file that caps
  torch below its newest release; this environment's installs run with ``PIP_CONFIG_FILE=/dev/null`` so the cap
  is lifted for them only (never for ``make test`` or CI).

In each, the repository (on ``PYTHONPATH``, not installed) runs: ``fuse`` of the digits and the text fixtures,
``verify --generate`` of the text fixture against its fused folder, and the deploy tests
(``tests/test_deploy_llama.py``, ``tests/test_deploy_pt2.py``: the Hugging Face folder in transformers, the
decoder ONNX, a streamed fold of a sharded copy, ``model.pt2`` and ``model.onnx`` loaded without slabconv), and the
ONNX door's tests (``tests/test_onnx_in.py``, ``tests/test_doors.py``: ONNX files folded through onnx-ir and
onnxscript's optimizer, ``--simplify`` with onnxslim, the same decisions as the checkpoint door).

The results go to ``build/compat/<env>/result.json`` and, with ``--write-docs``, to the table of
``docs/compat.md``. Usage::

    python scripts/compat.py                 # both environments
    python scripts/compat.py --env floor     # one
    python scripts/compat.py --write-docs    # and rewrite docs/compat.md's table from the results

Exit code 0 when every step passed in every environment run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "compat"
DOC = ROOT / "docs" / "compat.md"
TEST_TOOLS = ["pytest", "hypothesis", "jsonschema", "scikit-learn", "yacs", "markdown-it-py"]
"""What the deploy tests need besides the package's dependencies (any version)."""
TABLE_START, TABLE_END = "<!-- compat table: start -->", "<!-- compat table: end -->"


def declared() -> dict[str, str]:
    """Package name -> declared lower bound, from ``pyproject.toml`` (dependencies, the ``hf`` and ``simplify``
    extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, str] = {}
    extras = project["optional-dependencies"]
    for requirement in [*project["dependencies"], *extras["hf"], *extras["simplify"]]:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)\s*(?:,.*)?", requirement)
        if match is None:
            raise SystemExit(f"pyproject.toml: {requirement!r} has no lower bound (>=X); compat needs one")
        out[match.group(1)] = match.group(2)
    return out


def run(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None, timeout: int = 3600) -> bool:
    """Run ``cmd``; its output goes to ``log`` (appended). True when it exits 0."""
    started = time.monotonic()
    with open(log or os.devnull, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
            ok = code.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        out.write(f"# exit {'0' if ok else 'non-zero'} after {time.monotonic() - started:.0f} s\n")
    return ok


def build(name: str, floors: dict[str, str], log: Path) -> Path:
    """Create ``build/compat/<name>`` and install the dependencies at the floor or the newest release."""
    venv = BUILD / name
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ)
    if name == "floor":
        wanted = [f"{pkg}=={version}" for pkg, version in floors.items()]
        upgrade: list[str] = []
    else:
        wanted = list(floors)
        upgrade = ["--upgrade"]
        env["PIP_CONFIG_FILE"] = os.devnull  # lift a machine-wide torch cap for this environment only
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if not run([*pip, *upgrade, *wanted, *TEST_TOOLS], env=env, log=log):
        raise SystemExit(f"{name}: installing the dependencies failed; see {log}")
    return python


def installed(python: Path, packages: list[str]) -> dict[str, str]:
    """The installed version of each package in that environment."""
    code = (
        "import json, sys\nfrom importlib.metadata import version\n"
        "print(json.dumps({p: version(p) for p in sys.argv[1:]}))"
    )
    out = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def steps(python: Path, work: Path) -> list[tuple[str, list[str]]]:
    """The end-to-end commands run in each environment, by name."""
    cli = [str(python), "-m", "slabconv"]
    text = work / "text-fused"
    return [
        ("fuse digits", [*cli, "fuse", "fixtures/digits-prepbn/checkpoint.pth", "--out", str(work / "digits")]),
        ("fuse text (LLaMA)", [*cli, "fuse", "fixtures/text-prepbn", "--out", str(text)]),
        ("verify --generate", [*cli, "verify", "fixtures/text-prepbn", str(text), "--generate", "8"]),
        (
            "deploy tests",
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_deploy_llama.py",
             "tests/test_deploy_pt2.py"],
        ),
        (
            "ONNX door tests",
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_onnx_in.py",
             "tests/test_doors.py"],
        ),
    ]  # fmt: skip


def check(name: str, floors: dict[str, str]) -> dict:
    """Build one environment and run every step in it; the result as a dict (also ``result.json``)."""
    BUILD.mkdir(parents=True, exist_ok=True)
    log = BUILD / f"{name}.log"
    log.write_text("")
    python = build(name, floors, log)
    work = BUILD / name / "work"
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)
    results = {}
    for label, cmd in steps(python, work):
        started = time.monotonic()
        ok = run(cmd, env=env, log=log)
        results[label] = {"passed": ok, "seconds": round(time.monotonic() - started)}
        print(f"{name}: {label}: {'pass' if ok else 'FAIL'} ({results[label]['seconds']} s)", flush=True)
    result = {
        "env": name,
        "date": datetime.date.today().isoformat(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "versions": installed(python, list(floors)),
        "steps": results,
        "passed": all(r["passed"] for r in results.values()),
    }
    (BUILD / name / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(floors: dict[str, str], results: dict[str, dict]) -> str:
    """The markdown table of docs/compat.md: one row per package, one column per environment."""
    floor, newest = results.get("floor", {}), results.get("newest", {})

    def verdict(r: dict) -> str:
        if not r:
            return "not run"
        failed = [k for k, v in r["steps"].items() if not v["passed"]]
        return "pass" if not failed else "FAIL: " + ", ".join(failed)

    lines = [
        "| package | declared floor | installed at the floor | newest installed |",
        "|---|---|---|---|",
    ]
    for pkg, low in floors.items():
        at_floor, at_newest = floor.get("versions", {}).get(pkg, "-"), newest.get("versions", {}).get(pkg, "-")
        lines.append(f"| {pkg} | {low} | {at_floor} | {at_newest} |")
    lines += [
        "",
        "| environment | date | Python | fuse digits, fuse text, verify --generate, deploy tests, ONNX door tests |",
        "|---|---|---|---|",
    ]
    for name, r in (("floor", floor), ("newest", newest)):
        lines.append(f"| {name} | {r.get('date', '-')} | {r.get('python', '-')} | {verdict(r)} |")
    return "\n".join(lines)


def write_docs(floors: dict[str, str]) -> None:
    """Replace the table between the markers of docs/compat.md with the recorded results."""
    results = {}
    for name in ("floor", "newest"):
        path = BUILD / name / "result.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
    text = DOC.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    DOC.write_text(text[:start] + "\n" + table(floors, results) + "\n" + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=["floor", "newest", "both"], default="both")
    parser.add_argument("--write-docs", action="store_true", help="rewrite docs/compat.md's table from the results")
    args = parser.parse_args()
    floors = declared()
    names = ["floor", "newest"] if args.env == "both" else [args.env]
    results = [check(name, floors) for name in names]
    if args.write_docs:
        write_docs(floors)
    for r in results:
        print(f"{r['env']}: {'PASSED' if r['passed'] else 'FAILED'} ({json.dumps(r['versions'])})")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
