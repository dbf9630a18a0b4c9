"""The distribution as a user installs it: its name beside NVIDIA's, and what its sdist and
wheel carry (built offline with ``python -m build --no-isolation`` from a copy of the sources)."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UPSTREAM_RECORD = "megatron_fsdp/__init__.py,,\nmegatron_fsdp/fully_shard.py,,\n"


def _fake_upstream(site: Path) -> None:
    """A ``megatron-fsdp`` 0.6.1 distribution record in ``site`` claiming ``megatron_fsdp/``."""
    info = site / "megatron_fsdp-0.6.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-fsdp\nVersion: 0.6.1\n")
    (info / "RECORD").write_text(UPSTREAM_RECORD)


def _import(pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(str(p) for p in pythonpath)}
    return subprocess.run([sys.executable, "-S", "-c", "import megatron_fsdp; print('imported', megatron_fsdp.__file__)"],
                          capture_output=True, text=True, env=env, cwd="/")


def test_upstream_installed_into_the_same_folder_stops_the_import(tmp_path):
    """pip put both distributions' files into one folder: the import names the clash and the remedy."""
    (tmp_path / "megatron_fsdp").symlink_to(REPO / "megatron_fsdp")
    _fake_upstream(tmp_path)
    result = _import([tmp_path])
    assert result.returncode != 0, result.stdout
    assert "holds files of both mfsdp and NVIDIA's megatron-fsdp" in result.stderr
    assert "pip uninstall -y megatron-fsdp mfsdp" in result.stderr


def test_upstream_shadowed_in_another_folder_is_named(tmp_path):
    """Upstream installed elsewhere, later on sys.path: this package runs, and a warning says so."""
    other = tmp_path / "other"
    (other / "megatron_fsdp").mkdir(parents=True)
    (other / "megatron_fsdp" / "__init__.py").write_text("raise RuntimeError('upstream ran')\n")
    _fake_upstream(other)
    result = _import([REPO, other])
    assert result.returncode == 0, result.stderr
    assert f"imported {REPO / 'megatron_fsdp' / '__init__.py'}" in result.stdout
    assert "NVIDIA's megatron-fsdp is also installed" in result.stderr and str(other / "megatron_fsdp") in result.stderr


def test_no_upstream_no_message(tmp_path):
    result = _import([REPO])
    assert result.returncode == 0 and result.stderr == "", result.stderr


COMMANDS = {
    "megatron-fsdp-pretrain-gpt": "megatron_fsdp.training.pretrain_gpt:main",
    "megatron-fsdp-preprocess-data": "megatron_fsdp.training.data.preprocess_data:main",
    "megatron-fsdp-plan": "megatron_fsdp.tools.plan_cli:main",
    "megatron-fsdp-convert": "megatron_fsdp.convert.cli:main",
}
LAUNCH = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
          "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --log-interval 1 --eval-iters 0 "
          "--plot-path none --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --use-megatron-fsdp "
          "--data-parallel-sharding-strategy optim_grads_params")


def _sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "megatron_fsdp", src / "megatron_fsdp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("build", reason="python -m build: pip install build")
    tmp_path = tmp_path_factory.mktemp("dist")
    src = _sources(tmp_path)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "out"), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "out").glob("mfsdp-*.whl")
    (sdist,) = (tmp_path / "out").glob("mfsdp-*.tar.gz")
    return wheel, sdist


def test_the_wheel_carries_the_tables_types_and_license(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_string(archive.read(metadata_name).decode())
        entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    assert "megatron_fsdp/py.typed" in names
    assert "megatron_fsdp/training/args/flag_data/megatron_lm_flags.csv" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "scripts/")) for n in names)
    assert meta["Name"] == "mfsdp" and meta["License-Expression"] == "Apache-2.0"
    for command, target in COMMANDS.items():
        assert f"{command} = {target}" in entry_points, command
    requires = meta.get_all("Requires-Dist")
    assert "torch<2.15,>=2.11" in requires and "numpy>=1.22" in requires
    assert 'transformer-engine[pytorch]; extra == "te"' in requires
    assert 'megatron-core<0.17,>=0.16.1; extra == "megatron"' in requires


def test_the_sdist_carries_the_sources_and_license(built):
    _, sdist = built
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    for expected in ("LICENSE", "pyproject.toml", "setup.py", "megatron_fsdp/py.typed",
                     "megatron_fsdp/training/args/flag_data/megatron_lm_flags.csv"):
        assert expected in names, expected


def test_the_installed_commands_run_from_the_wheel(built, tmp_path):
    """The wheel's console commands, installed away from this checkout: the launcher trains
    two iterations, the preprocessor writes an indexed dataset, the planner and the converter
    answer --help."""
    wheel, _ = built
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)

    def command(name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(target / "bin" / name), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    where = subprocess.run([sys.executable, "-c", "import megatron_fsdp; print(megatron_fsdp.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target)), where  # the wheel's copy, not this checkout's
    run = command("megatron-fsdp-pretrain-gpt", *LAUNCH.split())
    assert run.returncode == 0, run.stderr[-3000:]
    assert " iteration        2/       2 |" in run.stdout + run.stderr
    (tmp_path / "corpus.txt").write_text("One small document.\n\nAnother one.\n")
    prep = command("megatron-fsdp-preprocess-data", "--input", "corpus.txt", "--output-prefix", "corpus",
                   "--tokenizer-type", "ByteTokenizer", "--workers", "1")
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert (tmp_path / "corpus_text_document.bin").stat().st_size > 0
    for name in ("megatron-fsdp-plan", "megatron-fsdp-convert"):
        done = command(name, "--help")
        assert done.returncode == 0 and "usage:" in done.stdout, (name, done.stderr[-2000:])
