"""`./dev` (set-up messages, command dispatch, `./dev test`'s exit codes), pyproject.toml's
metadata, the commands the pages show (README.md, docs/*.md) and the README's quick start.

`./dev` runs against a fake environment: a `python3` on PATH whose `-m venv` builds a venv
whose `python` (and `jupyter`, `torchrun`) only log their arguments, and an `nvidia-smi`
that says whether there is a GPU. Every branch of the set-up runs in milliseconds, with no
network and no real install.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest

from tests.helpers.doc_snippets import PAGES, README, ROOT, python_blocks, run_snippet, section

README_TEXT = README.read_text()
PAGES_TEXT = "\n".join(page.read_text() for page in PAGES)

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("cksum") is None,
                                reason="./dev needs bash and cksum")

STUB_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
[ -n "${FAKE_LOG_OMP:-}" ] && echo "OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-} OMP_NUM_THREADS=${OMP_NUM_THREADS:-}" >> "$FAKE_LOG"
case "$*" in
  "-c import torch") [ -n "${FAKE_HAS_TORCH:-}" ]; exit $? ;;
  "-m pytest"*) exit "${FAKE_PYTEST_RC:-0}" ;;
esac
"""
STUB_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$FAKE_LOG"
"""
# relocatable: puts its own directory first on PATH, like a real venv's activate
STUB_ACTIVATE = 'export PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd):$PATH"\n'
STUB_PYTHON3 = """#!/usr/bin/env bash
[ "$1 $2" = "-m venv" ] || { echo "fake python3: only -m venv" >&2; exit 99; }
mkdir -p "$3" && cp -r "$FAKE_TEMPLATE/." "$3"
"""


def _write(path, text, executable=True):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if executable:
        path.chmod(0o755)


def _stamp_name():
    out = subprocess.run(["cksum", str(ROOT / "pyproject.toml")], capture_output=True, text=True, check=True)
    return ".installed-" + out.stdout.split()[0]


class FakeDev:
    def __init__(self, tmp_path, gpu=False):
        self.venv = tmp_path / "venv"
        self.log = tmp_path / "log"
        self.log.write_text("")
        template = tmp_path / "template"
        _write(template / "bin" / "activate", STUB_ACTIVATE, executable=False)
        _write(template / "bin" / "python", STUB_PYTHON)
        for tool in ("jupyter", "torchrun"):
            _write(template / "bin" / tool, STUB_TOOL)
        self.bin = tmp_path / "fakebin"
        _write(self.bin / "python3", STUB_PYTHON3)
        _write(self.bin / "nvidia-smi", f"#!/usr/bin/env bash\nexit {0 if gpu else 1}\n")
        self.env = {k: v for k, v in os.environ.items() if k != "TRITON_DILATED_VENV"}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", FAKE_LOG=str(self.log),
                        FAKE_TEMPLATE=str(template), TRITON_DILATED_VENV=str(self.venv))

    def __call__(self, *args, **env):
        self.log.write_text("")
        return subprocess.run(["bash", str(ROOT / "dev"), *args], capture_output=True, text=True, timeout=60,
                              env={**self.env, **env}, cwd=str(self.venv.parent), check=False)

    def calls(self):
        return self.log.read_text().splitlines()


def _dev_lines(stderr):
    # the set-up time is the one part that varies
    return [re.sub(r"\d+ s$", "N s", line) for line in stderr.splitlines() if line.startswith("dev: ")]


def test_first_run_announces_each_step_and_installs_the_cpu_torch(tmp_path):
    dev = FakeDev(tmp_path, gpu=False)
    res = dev("true")
    assert res.returncode == 0, res.stderr
    assert _dev_lines(res.stderr) == [
        f"dev: first run: setting up {dev.venv} (about a minute and a half and 2.4 GB of disk)",
        "dev: creating the virtual environment",
        "dev: upgrading pip",
        "dev: installing torch 2.13.0+cpu, the CPU build (no NVIDIA GPU found)",
        "dev: installing triton_dilated (editable) with its dev extras: triton, pytest, matplotlib, ...",
        "dev: set-up done in N s",
    ]
    assert dev.calls() == [
        "python -m pip install --quiet --upgrade pip",
        "python -c import torch",
        "python -m pip install --quiet torch==2.13.0+cpu",
        "python -m pip install --quiet -e .[dev]",
    ]
    assert (dev.venv / _stamp_name()).is_file()


def test_a_gpu_machine_gets_the_cuda_torch(tmp_path):
    dev = FakeDev(tmp_path, gpu=True)
    res = dev("true")
    assert res.returncode == 0, res.stderr
    assert "dev: installing torch, the CUDA build (nvidia-smi sees a GPU)" in _dev_lines(res.stderr)
    assert "python -m pip install --quiet torch" in dev.calls()


def test_later_runs_reuse_the_environment(tmp_path):
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    res = dev("python", "-c", "print(1)")
    assert res.returncode == 0, res.stderr
    assert _dev_lines(res.stderr) == [f"dev: using the environment in {dev.venv} (delete it to set up again)"]
    assert dev.calls() == ["python -c print(1)"]       # no pip


def test_a_changed_pyproject_reinstalls_the_package_but_not_torch(tmp_path):
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    (dev.venv / _stamp_name()).rename(dev.venv / ".installed-0")    # as if pyproject.toml had changed
    res = dev("true", FAKE_HAS_TORCH="1")
    assert res.returncode == 0, res.stderr
    lines = _dev_lines(res.stderr)
    assert lines[0] == f"dev: pyproject.toml changed since {dev.venv} was set up: updating it"
    assert "dev: torch is already installed" in lines
    assert not [c for c in dev.calls() if "torch" in c and "pip" in c]
    assert dev.calls()[-1] == "python -m pip install --quiet -e .[dev]"


@pytest.mark.parametrize("pytest_rc, dev_rc", [(0, 0), (1, 1), (5, 1)])
def test_dev_test_runs_pytest_and_fails_when_nothing_was_collected(tmp_path, pytest_rc, dev_rc):
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    res = dev("test", "-k", "some_test", FAKE_PYTEST_RC=str(pytest_rc))
    assert res.returncode == dev_rc
    assert dev.calls() == ["python -m pytest -n 2 -q -k some_test"]
    assert ("pytest collected no tests: failing" in res.stderr) == (pytest_rc == 5)


@pytest.mark.parametrize("pytest_rc, dev_rc", [(0, 0), (5, 1)])
def test_dev_quick_runs_the_quick_marker(tmp_path, pytest_rc, dev_rc):
    """Issue 34 item 6: `./dev quick` is `./dev test -m quick` (the same exit rules)."""
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    res = dev("quick", "-x", FAKE_PYTEST_RC=str(pytest_rc))
    assert res.returncode == dev_rc
    assert dev.calls() == ["python -m pytest -n 2 -q -m quick -x"]


def test_quick_subset_names_each_variants_oracle_test_and_skips_say_why():
    """conftest.QUICK: every id still names a test (collected with -m quick: exactly those), one
    per variant at least (dilated, block-sparse, indexed, ring step, decode, with_kvcache) on both paths;
    the markers are registered (--strict-markers) and skipped tests print their reason (-rs)."""
    from tests.conftest import QUICK
    options = _pyproject()["tool"]["pytest"]["ini_options"]
    assert {"-rs", "--strict-markers"} <= set(options["addopts"].split())
    assert any(m.startswith("quick: ") for m in options["markers"])
    files = sorted({q.split("::")[0] for q in QUICK})
    assert files == ["tests/ops/block_sparse/test_block_sparse.py", "tests/ops/dilated/test_dilated.py",
                     "tests/ops/indexed/test_indexed.py", "tests/ops/ring/test_ring.py", "tests/serve/test_decode.py",
                     "tests/serve/test_with_kvcache.py"]
    assert any("[triton" in q or "triton]" in q for q in QUICK) and any("torch" in q for q in QUICK)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick", "-p", "no:cacheprovider",
                           *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert proc.returncode == 0 and sorted(collected) == sorted(QUICK), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_other_commands_run_inside_the_environment(tmp_path):
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    assert dev("perf", "ring", "--quick").returncode == 0
    assert dev.calls() == ["python -m triton_dilated.perf ring --quick"]
    # the README's ring commands: torchrun is the venv's (installed with torch)
    assert dev("torchrun", "--nproc_per_node=4", "examples/ring_demo.py").returncode == 0
    assert dev.calls() == ["torchrun --nproc_per_node=4 examples/ring_demo.py"]


NO_OMP = dict(OMP_NUM_THREADS="", OMP_WAIT_POLICY="", GOMP_SPINCOUNT="", FAKE_LOG_OMP="1")


def test_perf_makes_idle_openmp_threads_wait_passively_unless_the_user_chose(tmp_path):
    """Spinning idle threads made CPU benchmarks 10x slower on a shared machine: ./dev perf sets
    OMP_WAIT_POLICY=PASSIVE (and says so) unless the user set the threads or the wait policy."""
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    res = dev("perf", "--quick", **NO_OMP)
    assert res.returncode == 0, res.stderr
    assert dev.calls() == ["python -m triton_dilated.perf --quick", "OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS="]
    assert any(line.startswith("dev: OMP_WAIT_POLICY=PASSIVE for the benchmark") for line in _dev_lines(res.stderr))
    for mine in (dict(OMP_NUM_THREADS="1"), dict(OMP_WAIT_POLICY="ACTIVE"), dict(GOMP_SPINCOUNT="1000")):
        res = dev("perf", **{**NO_OMP, **mine})
        assert res.returncode == 0, res.stderr
        assert dev.calls()[1] == (f"OMP_WAIT_POLICY={mine.get('OMP_WAIT_POLICY', '')} "
                                  f"OMP_NUM_THREADS={mine.get('OMP_NUM_THREADS', '')}")
        assert not any("OMP_WAIT_POLICY=PASSIVE" in line for line in _dev_lines(res.stderr))
    dev("test", **NO_OMP)
    assert dev.calls()[1] == "OMP_WAIT_POLICY= OMP_NUM_THREADS="      # only the benchmarks


def test_notebooks_installs_jupyterlab_once_then_opens_the_notebooks(tmp_path):
    dev = FakeDev(tmp_path)
    assert dev("true").returncode == 0
    res = dev("notebooks")
    assert res.returncode == 0, res.stderr
    assert _dev_lines(res.stderr)[1:] == ["dev: installing JupyterLab (the notebooks extra; once)",
                                          "dev: starting JupyterLab on notebooks/ (Ctrl-C stops it)"]
    assert dev.calls() == ["python -m pip install --quiet -e .[dev,notebooks]", "jupyter lab notebooks"]
    res = dev("jupyter", "lab", "--version")
    assert res.returncode == 0, res.stderr
    assert dev.calls() == ["jupyter lab --version"]    # installed already


# ----------------------------------------------------------------------------- pyproject.toml

def _pyproject():
    try:
        import tomllib
    except ImportError:          # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_pyproject_license_is_an_spdx_string():
    meta = _pyproject()
    assert meta["project"]["license"] == "MIT"      # not the deprecated table form {text = ...}
    req = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert req == ["setuptools>=77"]                # the first setuptools that reads SPDX strings


def test_setuptools_reads_pyproject_without_a_deprecation_warning():
    pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert dist.metadata.license_expression == "MIT"
    assert [str(w.message) for w in caught if "deprecat" in str(w.message).lower()] == []


def test_jupyterlab_is_an_extra_of_its_own_not_in_dev():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert [r for r in extras["notebooks"] if r.startswith("jupyterlab")]
    assert not [r for r in extras["dev"] if r.startswith(("jupyterlab", "notebook", "jupyter"))]


# ----------------------------------------------------------------------------- README and docs

def test_readme_states_the_set_up_cost_dev_announces():
    note = re.search(r'^SETUP_NOTE="([^"]+)"', (ROOT / "dev").read_text(), re.MULTILINE).group(1)
    assert note in " ".join(section(README_TEXT, "Install").split())


def test_pages_run_torchrun_through_dev():
    lines = [ln.strip() for ln in PAGES_TEXT.splitlines() if re.match(r"\s*(\./dev\s+)?torchrun\b", ln)]
    assert lines, "no page shows a torchrun command"
    assert all(ln.startswith("./dev torchrun ") for ln in lines), lines


def test_pages_dev_commands_exist():
    dev = (ROOT / "dev").read_text()
    used = set(re.findall(r"^\./dev (\w+)", PAGES_TEXT, re.MULTILINE))
    assert {"test", "perf", "notebooks", "torchrun"} <= used
    for cmd in used - {"torchrun", "python"}:     # torchrun and python run as any command does
        assert re.search(rf"^\s*(\w+\|)*{cmd}(\|\w+)*\)", dev, re.MULTILINE), f"./dev has no {cmd!r} command"



def test_paths_under_tests_that_pages_and_scripts_name_exist():
    """Issue 31 item 6 moved every test file: each tests/... path that the pages, ./dev,
    pyproject.toml, the CI script, perf/gpu_check.sh or the tests themselves name exists."""
    sources = [*PAGES, ROOT / "dev", ROOT / "pyproject.toml", ROOT / ".ci" / "run", ROOT / "perf" / "gpu_check.sh",
               *sorted((ROOT / "tests").rglob("*.py"))]
    named = {(src, path) for src in sources if src.is_file()
             for path in re.findall(r"(?<![\w/.-])tests/(?:\w+/)*\w+(?:\.py)?", src.read_text())}
    assert any(path.endswith(".py") for _, path in named), "no page names a test file"
    missing = sorted(f"{src.relative_to(ROOT)}: {path}" for src, path in named if not (ROOT / path).exists())
    assert not missing, "\n".join(missing)

def test_readme_install_lines_quote_extras_and_name_no_pypi_package():
    """zsh globs an unquoted `.[hf]`; there is no package on PyPI, so every install is from the clone."""
    installs = [ln.strip() for ln in section(README_TEXT, "Install").splitlines() if "pip install" in ln]
    assert installs
    for line in installs:
        assert not re.search(r"pip install[^#]*\[", line) or re.search(r'"\.\[[\w,]+\]"', line), line
        assert "triton_dilated" not in line.split("#")[0], line       # never `pip install triton_dilated`


LINE = re.compile(r"dilated attention on (cpu|cuda): out \((\d+), (\d+), (\d+), (\d+)\) torch\.(\w+), "
                  r"max \|out - float64 oracle\| = (\S+)")


def test_quick_start_snippet_runs_and_prints_what_the_readme_shows(tmp_path):
    quick = section(README_TEXT, "Quick start")
    code = python_blocks(quick)
    shown = re.findall(r"```text\n(.*?)```", quick, re.DOTALL)
    assert len(code) == 1 and code[0]["mark"] == "runnable" and len(shown) == 1
    shown = shown[0].strip()
    assert LINE.fullmatch(shown), shown                # the README's example has the snippet's format
    res = run_snippet(code[0]["code"], tmp_path)
    assert res.returncode == 0, res.stderr
    printed = res.stdout.strip().splitlines()[-1]
    m = LINE.fullmatch(printed)
    assert m, printed
    err = float(m.group(7))
    assert math.isfinite(err) and err < (1e-4 if m.group(6) == "float32" else 5e-2), printed
    if m.group(1) == "cpu":      # the README shows the CPU line: the same but for the error's digits
        assert printed.rsplit("=", 1)[0] == shown.rsplit("=", 1)[0]
