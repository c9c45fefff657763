"""Turn a kernel repository on disk into an offline Hugging Face cache snapshot plus a kernels.lock entry.

    python scripts/kernel_offline_cache.py REPO_DIR --lock kernels.lock [--repo-id deepinfer/sparse-mla]
        [--cache DIR] [--commit SHA]

REPO_DIR is a repository built by scripts/build_kernel_repo.py or one downloaded from the Hub (a directory
holding build/<variant>/). Every variant is verified first (engine/kernel_repo.py: each file against its
metadata.json's digest). Then, in the cache (--cache, else KERNELS_CACHE, else the Hugging Face hub cache):
  kernels--<org>--<name>/snapshots/<commit>/build/...  the files (bytecode caches left out)
  kernels--<org>--<name>/refs/v<N>                     the commit (N: the variants' metadata version)
and the lock file gets (or replaces) the entry {"dependency": {"repo-id", "version": N}, "lock": {"commit"}}
in kernels' format, other entries kept. The commit is --commit (a downloaded repository's Hub commit),
else derived from the content (sha1 over every file's path and sha256): the same files give the same
commit. Copy the cache directory and the lock file to the nodes; there, with HF_HUB_OFFLINE=1,
kernels.get_locked_kernel / load_kernel / LockedLayerRepository load that commit, and the engine loads it
with the variables this script prints (it verifies the digest before the import; kernels does not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import kernel_repo  # noqa: E402

_COMMIT = re.compile(r"[0-9a-f]{40}")


def repo_files(repo_dir: Path) -> dict[str, Path]:
    """Relative path (from repo_dir) -> file, for every file under build/ (bytecode caches left out)."""
    build = repo_dir / "build"
    return {p.relative_to(repo_dir).as_posix(): p for p in sorted(build.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def content_commit(files: dict[str, Path]) -> str:
    listing = "".join(f"{rel}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n" for rel, p in files.items())
    return hashlib.sha1(listing.encode()).hexdigest()


def repository_version(repo_dir: Path) -> int:
    versions = {json.loads((v / "metadata.json").read_text()).get("version")
                for v in kernel_repo.variant_dirs(repo_dir)}
    if len(versions) != 1 or not isinstance(next(iter(versions)), int):
        raise SystemExit(f"kernel_offline_cache: {repo_dir}: the variants' metadata versions are "
                         f"{sorted(map(str, versions))}; expected one integer")
    return versions.pop()


def default_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)


def write_snapshot(cache: Path, repo_id: str, commit: str, version: int, files: dict[str, Path]) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    folder = cache / repo_folder_name(repo_id=repo_id, repo_type="kernel")
    snapshot = folder / "snapshots" / commit
    if snapshot.exists():
        have = repo_files(snapshot)
        same = have.keys() == files.keys() and all(have[r].read_bytes() == p.read_bytes() for r, p in files.items())
        if not same:
            raise SystemExit(f"kernel_offline_cache: {snapshot} exists with other files; "
                             "remove it or use another commit")
    else:
        tmp = snapshot.with_name(snapshot.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, src in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
        tmp.rename(snapshot)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / f"v{version}").write_text(commit)
    return snapshot


def write_lock(lockfile: Path, repo_id: str, version: int, commit: str) -> None:
    from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

    locks = {}
    if lockfile.exists():
        old = KernelLocks.from_json(lockfile.read_text())
        locks = {dep: lock for dep, lock in old.items() if dep.repo_id != repo_id}
    locks[KernelDependency(repo_id, KernelVersion.Version(version))] = KernelLock(commit)
    lockfile.parent.mkdir(parents=True, exist_ok=True)
    lockfile.write_text(KernelLocks(locks).to_json() + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo_dir", type=Path, help="a kernel repository (holding build/<variant>/)")
    ap.add_argument("--lock", type=Path, required=True, help="the kernels.lock to write (other entries are kept)")
    ap.add_argument("--repo-id", default="deepinfer/sparse-mla", help="org/name (default deepinfer/sparse-mla)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="cache directory (default: KERNELS_CACHE, else the Hugging Face hub cache)")
    ap.add_argument("--commit", default=None, help="40-hex commit (default: derived from the content)")
    args = ap.parse_args(argv)
    if args.commit is not None and not _COMMIT.fullmatch(args.commit):
        ap.error(f"--commit: expected 40 lowercase hex digits, got {args.commit!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", args.repo_id):
        ap.error(f"--repo-id: expected org/name, got {args.repo_id!r}")
    repo_dir = args.repo_dir.resolve()
    try:
        digests = kernel_repo.verify_repo(repo_dir)
    except kernel_repo.KernelRepoError as exc:
        print(f"kernel_offline_cache: {exc}", file=sys.stderr)
        return 1
    version = repository_version(repo_dir)
    files = repo_files(repo_dir)
    commit = args.commit or content_commit(files)
    cache = (args.cache or default_cache_dir()).resolve()
    snapshot = write_snapshot(cache, args.repo_id, commit, version, files)
    write_lock(args.lock, args.repo_id, version, commit)
    for path, digest in digests.items():
        print(f"verified {path.name}: digest {digest}")
    print(f"snapshot {snapshot}\nlock {args.lock.resolve()}: {args.repo_id} v{version} at commit {commit}")
    print("on the nodes:\n"
          f"  export HF_HUB_OFFLINE=1 KERNELS_CACHE={cache}\n"
          f"  export DEEPINFER_KERNEL_SOURCE=hub DEEPINFER_KERNEL_REPO={args.repo_id}@v{version} "
          f"DEEPINFER_KERNEL_LOCK={args.lock.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
