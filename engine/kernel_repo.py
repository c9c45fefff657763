"""Kernel repositories (the `kernels` library's layout): located, verified, then imported through `kernels`.

A repository holds build/<variant>/ directories (this project builds the noarch variants torch-cpu and
torch-cuda: scripts/build_kernel_repo.py); each has a metadata.json whose `digest` lists the sha256 of
every file of the variant (kernels' rule: metadata.json*, *.pyc and __pycache__/ are not listed). The
`kernels` library (0.17.2) imports a variant without checking those hashes, so this module checks every
variant of the repository with kernels' own Digest before the import and refuses one with an edited,
added or missing file (KernelVerificationError names each file) or without a digest.

Two sources:
- a local repository (a directory holding build/): kernels.get_local_kernel(path);
- org/name@revision through a lock file: the lock (kernels' kernels.lock format) pins the commit, the
  files come from the Hugging Face cache's snapshot of that commit (KERNELS_CACHE, else the hub cache;
  scripts/kernel_offline_cache.py writes one), kernels.load_kernel(repo_id, lockfile=...) imports it and
  never downloads. "vN" names the lock's version-N dependency; another revision must equal the lock's
  revision or its commit.

After the import, the variant that kernels chose must be one of the verified ones, and every module of
the kernel's package must come from it (kernels imports a variant under the `id` of its metadata; a
second copy with the same id would pick up the first copy's submodules).

LoadedKernel.digest is the sha256 of the chosen variant's metadata.json: it lists every file's sha256, so
two processes that verified variants with equal digests run byte-identical files.

What this does not do: detect a signed attacker (metadata.json is not signed offline; signature
verification with sigstore needs the Hub), check bytecode caches (__pycache__ is outside the digest).
`kernels` is imported here only, on first use.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .config import LocalKernelRepo, LockedKernelRepo


class KernelRepoError(RuntimeError):
    """A kernel repository cannot be resolved (missing path, snapshot, lock entry, variant) or verified."""


class KernelVerificationError(KernelRepoError):
    """A variant's files do not match the digest of its metadata.json (or it has none)."""


@dataclass(frozen=True)
class LoadedKernel:
    module: ModuleType
    repo: str  # "org/name@revision" or the local path
    commit: str | None  # the locked commit; None for a local repository
    variant: str  # e.g. "torch-cuda"
    variant_path: Path
    digest: str  # sha256 (hex) of the variant's metadata.json

    def describe(self) -> str:
        at = f" commit {self.commit}" if self.commit else ""
        return f"{self.repo}{at} variant {self.variant} digest {self.digest[:12]}"


def _kernels():
    try:
        import kernels
    except ModuleNotFoundError as exc:
        if exc.name != "kernels":
            raise
        raise KernelRepoError("the `kernels` package is not installed (pip install kernels==0.17.2; "
                              "pyproject's `hf-kernels` extra)") from exc
    return kernels


def variant_dirs(repo_root: Path) -> list[Path]:
    """The variant directories of a repository: every directory of repo_root/build."""
    build = Path(repo_root) / "build"
    if not build.is_dir():
        raise KernelRepoError(f"{repo_root}: no build/ directory (not a kernel repository)")
    variants = sorted(p for p in build.iterdir() if p.is_dir())
    if not variants:
        raise KernelRepoError(f"{build}: no variant directory")
    return variants


def verify_variant(variant_path: Path) -> str:
    """Check every file of the variant against its metadata.json's digest with kernels' Digest; returns
    the sha256 of metadata.json. Raises KernelVerificationError naming every edited, added or missing file."""
    kernels = _kernels()
    from kernels._rust import Digest, DigestValidationError, DigestViolation

    variant_path = Path(variant_path)
    meta_path = variant_path / "metadata.json"
    if not meta_path.is_file():
        raise KernelVerificationError(f"{variant_path}: no metadata.json")
    meta_bytes = meta_path.read_bytes()
    try:
        metadata = kernels.Metadata.from_bytes(meta_bytes)
    except ValueError as exc:
        raise KernelVerificationError(f"{meta_path}: {exc}") from exc
    if metadata.digest is None:
        raise KernelVerificationError(f"{meta_path}: no digest, so its files cannot be verified")
    actual = Digest.hash_variant(metadata.digest.algorithm, variant_path)
    try:
        metadata.digest.validate(actual)
    except DigestValidationError as exc:
        problems = []
        for v in exc.violations:
            if isinstance(v, DigestViolation.HashMismatch):
                problems.append(f"edited file {v.path}")
            elif isinstance(v, DigestViolation.UnknownFile):
                problems.append(f"added file {v.path}")
            elif isinstance(v, DigestViolation.MissingFile):
                problems.append(f"missing file {v.path}")
            else:
                problems.append(str(v))
        raise KernelVerificationError(f"{variant_path}: does not match its metadata.json digest: "
                                      + "; ".join(problems)) from None
    return hashlib.sha256(meta_bytes).hexdigest()


def verify_repo(repo_root: Path) -> dict[Path, str]:
    """verify_variant over every variant of the repository: {variant path (resolved): digest}."""
    return {p.resolve(): verify_variant(p) for p in variant_dirs(repo_root)}


def read_lock(lockfile: Path, repo_id: str) -> tuple[str, str]:
    """(commit, dependency) of repo_id in a kernels.lock; dependency is "vN" or the locked revision."""
    _kernels()  # the error when it is missing
    from kernels._rust import KernelLocks, KernelVersion

    lockfile = Path(lockfile)
    if not lockfile.is_file():
        raise KernelRepoError(f"lock file {lockfile} does not exist")
    try:
        locks = KernelLocks.from_json(lockfile.read_text())
    except ValueError as exc:
        raise KernelRepoError(f"lock file {lockfile}: {exc}") from exc
    for dep, lock in locks.items():
        if dep.repo_id == repo_id:
            version = dep.version
            named = (f"v{version.version}" if isinstance(version, KernelVersion.Version) else version.revision)
            return lock.commit, named
    raise KernelRepoError(f"lock file {lockfile} does not lock {repo_id} "
                          f"(it locks {', '.join(sorted(d.repo_id for d in locks.keys())) or 'nothing'})")


def snapshot_path(repo_id: str, commit: str) -> Path:
    """The offline cache's snapshot of repo_id at commit (where kernels.load_kernel reads it)."""
    _kernels()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from kernels.hf_hub import CACHE_DIR

    try:
        return Path(snapshot_download(repo_id, repo_type="kernel", revision=commit, cache_dir=CACHE_DIR,
                                      local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise KernelRepoError(f"no snapshot of {repo_id} at commit {commit} in the offline cache "
                              f"({CACHE_DIR or 'the Hugging Face hub cache'}); write one with "
                              "scripts/kernel_offline_cache.py") from exc


def _loaded(module: ModuleType, verified: dict[Path, str], repo: str, commit: str | None) -> LoadedKernel:
    variant_path = Path(module.__file__).resolve().parent.parent
    if variant_path not in verified:
        raise KernelRepoError(f"{repo}: kernels imported {variant_path}, which is not a verified variant")
    for name, mod in list(sys.modules.items()):
        if name.partition(".")[0] != module.__name__:
            continue
        file = getattr(mod, "__file__", None)
        if file is None or not Path(file).resolve().is_relative_to(variant_path):
            raise KernelRepoError(f"{repo}: module {name} comes from {file}, not from the verified variant "
                                  f"{variant_path} (another copy of kernel {module.__name__} was imported first)")
    return LoadedKernel(module, repo, commit, variant_path.name, variant_path, verified[variant_path])


def load(repo: LocalKernelRepo | LockedKernelRepo, lockfile: Path | None = None) -> LoadedKernel:
    """Verify every variant of the repository, then import the one kernels chooses for this system."""
    kernels = _kernels()
    if isinstance(repo, LocalKernelRepo):
        root = repo.path.resolve()
        if not root.is_dir():
            raise KernelRepoError(f"kernel repository {root} does not exist")
        verified = verify_repo(root)
        try:
            module = kernels.get_local_kernel(root)
        except FileNotFoundError as exc:  # no variant for this system
            raise KernelRepoError(f"{root}: {exc}") from exc
        return _loaded(module, verified, str(root), None)
    if lockfile is None:
        raise KernelRepoError(f"{repo}: a locked repository needs a lock file")
    commit, dependency = read_lock(lockfile, repo.repo_id)
    if repo.revision not in (dependency, commit):
        raise KernelRepoError(f"{repo} asks for revision {repo.revision}, but {lockfile} locks {repo.repo_id} "
                              f"{dependency} at commit {commit}")
    verified = verify_repo(snapshot_path(repo.repo_id, commit))
    try:
        module = kernels.load_kernel(repo.repo_id, lockfile=Path(lockfile))
    except FileNotFoundError as exc:
        raise KernelRepoError(f"{repo}: {exc}") from exc
    return _loaded(module, verified, str(repo), commit)
