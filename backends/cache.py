"""Cache entries on disk: how every kspec build cache writes, verifies, installs and discards one.

Used by the nvcc compile cache (`backends/build.py`), the CuTe DSL GEMM cache (`backends/cute/build.py`)
and the FlashAttention-4 attention cache (`backends/cute/attention.py`); `json_put`/`json_get` are the
same rules for the one-file memos (the emit memo and the resources memo of `kspec/compile.py`).

An entry is a directory built in a temporary sibling, sealed, then renamed into place (readers see
no entry or a whole one).  `seal` writes `meta.json` with, under "files", the size and sha256 of
every other file of the entry, and under "digest" the sha256 of the metadata itself, so a byte
changed anywhere, meta.json included, is found by `verify`.  A damaged entry is never served:
`read` removes it (atomically: renamed aside first, then deleted) with one warning line, and the
caller rebuilds.  A stale entry (written by another format) is removed without a warning.
`install` keeps an entry another process installed first if it verifies; a rename that still
fails is an error, never ignored.

Work directories (`workdir`) are made with the process umask (entries are as readable as any other
file the user writes, so a team can share a cache) and held with an `flock` on the directory for
as long as their builder lives: the kernel drops the lock when the process dies, `kill -9`
included, so `reclaim` can tell a dead builder's leftovers from a live build (on any host or PID
namespace sharing the file system) and removes them at once.  Where the file system has no locks,
only leftovers older than a day are removed.  `usable_root` checks that a cache root can be written,
and otherwise falls back to a temporary cache for the run, with one warning.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kspec.core import KspecError, os_problem

META = "meta.json"
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(work: Path, meta: dict) -> dict:
    """Record every file under `work` (but meta.json) in `meta` and write `work/meta.json`."""
    files = {}
    for p in sorted(work.rglob("*")):
        if p.is_file() and p.relative_to(work).as_posix() != META:
            files[p.relative_to(work).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
    meta = {**{k: v for k, v in meta.items() if k not in ("files", "digest")}, "files": files}
    meta["digest"] = _meta_digest(meta)
    (work / META).write_text(json.dumps(meta, indent=1))
    return meta


class Stale(Exception):
    """An entry of another format: not damage, just not ours to read."""


def verify(d: Path, fmt) -> tuple[dict | None, str | None]:
    """(meta, None) for a whole entry of format `fmt`; (None, None) when there is none (or it is
    stale); (None, reason) when it is damaged."""
    try:
        text = (d / META).read_text()
    except FileNotFoundError:
        return None, (None if not d.exists() else f"{META} is missing")
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{META} cannot be read ({getattr(e, 'strerror', None) or e})"
    try:
        meta = json.loads(text)
    except ValueError:
        return None, f"{META} is not valid JSON"
    if not isinstance(meta, dict):
        return None, f"{META} is not an object"
    if meta.get("format") != fmt or "digest" not in meta:
        raise Stale()
    if meta["digest"] != _meta_digest(meta):
        return None, f"{META} does not match its own digest"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return None, f"{META} lists no files"
    for rel, rec in files.items():
        p = d / rel
        if rel.startswith("/") or ".." in Path(rel).parts:
            return None, f"{META} names a file outside the entry ({rel!r})"
        try:
            st = p.lstat()
        except FileNotFoundError:
            return None, f"{rel} is missing"
        except OSError as e:
            return None, f"{rel} cannot be read ({e.strerror})"
        if not p.is_file() or p.is_symlink():
            return None, f"{rel} is not a regular file"
        if st.st_size != rec.get("bytes"):
            return None, f"{rel} has {st.st_size} bytes, {rec.get('bytes')} when written"
        try:
            if sha256_of(p) != rec.get("sha256"):
                return None, f"{rel} does not match its sha256"
        except OSError as e:
            return None, f"{rel} cannot be read ({e.strerror})"
    return meta, None


_DISCARD_HINT = "check the permissions of the cache directory, or clear it with `kspec cache clear`"


def discard(d: Path, what: str = "the damaged cache entry", hint: str = _DISCARD_HINT) -> None:
    """Move an entry aside atomically, then delete it (a concurrent reader sees all or nothing).
    A rename that fails is a KspecError naming `what` and the path; a deletion that fails after it
    leaves a `.discard-*` folder that `reclaim` removes later."""
    trash = d.with_name(f"{DISCARD_PREFIX}{d.name[:16]}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, trash)
    except FileNotFoundError:
        return                  # another process removed it first
    except OSError as e:
        raise KspecError(f"cannot remove {what} {d}: {e.strerror}", hint=hint) from None
    shutil.rmtree(trash, ignore_errors=True)


def warn_damaged(d: Path, reason: str) -> None:
    print(f"kspec: warning: cache entry {d} is damaged ({reason}); removed, rebuilding it", file=sys.stderr)


def read(d: Path, fmt, on_damage=None) -> dict | None:
    """The metadata of the whole entry `d`, or None after removing a damaged or stale one.
    on_damage(d, reason) is called for damage (default: one warning line on stderr)."""
    try:
        meta, why = verify(d, fmt)
    except Stale:
        discard(d)
        return None
    if why is not None:
        (on_damage or warn_damaged)(d, why)
        discard(d)
    return meta


def install(work: Path, d: Path, fmt) -> dict:
    """Rename the sealed directory `work` to `d`; the verified metadata of what is there after.
    If a whole entry is already there (another process built the same key), it is kept and `work`
    is left for the caller to delete; a damaged one in the way is removed and the rename retried."""
    d.parent.mkdir(parents=True, exist_ok=True)
    err: OSError | None = None
    for _ in range(3):
        try:
            os.rename(work, d)
        except OSError as e:
            err = e
            meta = read(d, fmt)
            if meta is not None:
                return meta
            continue
        meta, why = verify(d, fmt)
        if meta is None:
            raise KspecError(f"the cache entry {d} is damaged right after it was written ({why})",
                             hint="the cache directory's file system may be failing; set KSPEC_CACHE_DIR elsewhere")
        return meta
    raise KspecError(f"cannot write the cache entry {d}: {err.strerror if err else 'unknown error'}",
                     hint="check the permissions of the cache directory (KSPEC_CACHE_DIR), or clear it with "
                          "`kspec cache clear`")


def json_put(path: Path, data) -> None:
    """Write a one-file memo atomically, with its sha256 alongside the data."""
    body = json.dumps(data, sort_keys=True)
    text = json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "data": body})
    path.parent.mkdir(parents=True, exist_ok=True)
    name = f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    new, tmp = path.with_name(name + NEW_SUFFIX), path.with_name(name + ".tmp")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # held while written (see reclaim_dir)
        except OSError:
            pass
        os.rename(new, tmp)
        with os.fdopen(os.dup(fd), "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        os.close(fd)
        new.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def json_get(path: Path):
    """A memo written by json_put, or None (missing, or damaged: then removed with a warning)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        why = f"cannot be read ({getattr(e, 'strerror', None) or e})"
    else:
        try:
            outer = json.loads(text)
            if isinstance(outer, dict) and "sha256" not in outer and "data" not in outer:
                path.unlink(missing_ok=True)        # written by an older kspec: stale, not damaged
                return None
            body = outer["data"]
            if hashlib.sha256(body.encode()).hexdigest() == outer["sha256"]:
                return json.loads(body)
            why = "does not match its sha256"
        except (ValueError, KeyError, TypeError, AttributeError):
            why = "is not a kspec memo"
    warn_damaged(path, why)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise KspecError(f"cannot remove the damaged cache file {path}: {e.strerror}",
                         hint="check the permissions of the cache directory, or clear it with `kspec cache clear`") \
            from None
    return None


# ---------------------------------------------------------------------------------------------
# work directories, leftovers, the cache root
# ---------------------------------------------------------------------------------------------

DISCARD_PREFIX = ".discard-"
WORK_SUFFIX = ".kspec-work"       # every work directory's name ends with it (see `workdir`)
# A work directory or memo file is made under a NEW_SUFFIX name, locked, and only then renamed to
# its reclaimable name (the rename keeps the lock): a reclaimer never sees one unlocked while its
# builder lives.  A NEW_SUFFIX leftover (a builder killed in those microseconds) is reclaimed
# after UNLOCKED_S, as is anything on a file system that cannot lock.
NEW_SUFFIX = ".kspec-new"
UNLOCKED_S = 24 * 3600.0
_SHARD = re.compile(r"^[0-9a-f]{2}$")
_MEMO_TMP = re.compile(r"^\..+\.tmp$")     # json_put's and the tuning database's temporary files


def _mkdir_private_name(parent: Path, prefix: str) -> tuple[Path, int | None | bool]:
    """(a new locked work directory, its lock fd): mkdtemp, but with the umask's mode (mkdtemp
    makes 0700: unreadable to the rest of a team), locked before it takes its WORK_SUFFIX name."""
    for _ in range(100):
        name = f"{prefix}{uuid.uuid4().hex[:12]}"
        new = parent / f"{name}{NEW_SUFFIX}"
        try:
            os.mkdir(new, 0o777)
        except FileExistsError:
            continue
        fd = _try_lock(new)
        work = parent / f"{name}{WORK_SUFFIX}"
        try:
            os.rename(new, work)
        except BaseException:
            if type(fd) is int:
                os.close(fd)
            shutil.rmtree(new, ignore_errors=True)
            raise
        return work, fd
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent))


def _try_lock(path: Path) -> int | None | bool:
    """An fd holding an exclusive lock on the directory or file `path`; False if another process
    holds it; None if this file system cannot lock (or `path` is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:
        os.close(fd)
        return None
    return fd


@contextmanager
def workdir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new directory under `parent` (created with its parents) to build an entry in, locked for
    this process until the block ends, then deleted unless it was installed (renamed away)."""
    parent.mkdir(parents=True, exist_ok=True)
    work, fd = _mkdir_private_name(parent, prefix)
    try:
        yield work
    finally:
        try:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
        finally:
            if type(fd) is int:
                os.close(fd)


def _age(p: Path, now: float) -> float:
    """Seconds since `p` last changed (a work directory's mtime moves with every file made in it)."""
    try:
        return now - p.lstat().st_mtime
    except OSError:
        return -1.0


def reclaim_dir(parent: Path, work_only: bool = False) -> int:
    """Remove the leftovers of dead builders directly under `parent`: work directories (and memo
    temporary files) whose lock is free (see NEW_SUFFIX), and `.discard-*` folders (whoever sees
    one may finish deleting it), here
    and in the <key[:2]> folders.  work_only: work directories only (an output directory, where
    anything else is the user's).  Safe while other processes build: a live builder's lock is
    never taken from it.  Returns how many were removed."""
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    now, n = time.time(), 0
    for name in names:
        p = parent / name
        new = name.endswith(NEW_SUFFIX)
        if new or name.endswith(WORK_SUFFIX) or (not work_only and _MEMO_TMP.match(name)):
            fd = _try_lock(p)
            if fd is False or ((fd is None or new) and _age(p, now) < UNLOCKED_S):
                if type(fd) is int:
                    os.close(fd)
                continue
            try:                            # (holding its lock: no one else is in it)
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                n += 1
            except OSError:
                pass
            finally:
                if type(fd) is int:
                    os.close(fd)
        elif work_only:
            continue
        elif name.startswith(DISCARD_PREFIX):
            shutil.rmtree(p, ignore_errors=True)          # nobody's: whoever sees it may finish it
            n += 1
        elif _SHARD.match(name) and p.is_dir():           # <key[:2]>/: where entries are discarded
            n += reclaim_dir(p)
    return n


_RECLAIMED: set[tuple[str, str]] = set()
_RECLAIM_LOCK = threading.Lock()


def reclaim_once(parent: Path, *subdirs: str) -> None:
    """reclaim_dir(parent) and reclaim_dir(parent/sub) for each sub, once per process (the first
    build under a cache root pays a directory listing; later ones nothing)."""
    with _RECLAIM_LOCK:
        todo = [d for d in ("", *subdirs) if (str(parent), d) not in _RECLAIMED]
        _RECLAIMED.update((str(parent), d) for d in todo)
    for d in todo:
        reclaim_dir(parent / d if d else parent)


_USABLE: dict[str, Path] = {}


def usable_root(root: Path) -> Path:
    """`root` if this process can write there (creating it if needed); else a temporary cache
    directory for this run (removed at exit), with one warning naming the path and the problem."""
    key = str(root)
    if key in _USABLE:
        return _USABLE[key]
    problem = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", suffix=NEW_SUFFIX, dir=root)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        problem = "it exists and is not a directory" if root.exists() else os_problem(FileExistsError(), root)
    except OSError as e:
        problem = os_problem(e, root)
    if problem is None:
        _USABLE[key] = root
        return root
    try:
        tmp = Path(tempfile.mkdtemp(prefix="kspec-cache-"))
    except OSError as e:
        raise KspecError(f"the cache directory {root} cannot be written ({problem}), and no temporary one "
                         f"can be made either ({e.strerror})",
                         hint="set KSPEC_CACHE_DIR to a writable directory") from None
    atexit.register(shutil.rmtree, tmp, True)
    print(f"kspec: warning: the cache directory {root} cannot be written ({problem}); using a temporary "
          f"cache for this run ({tmp}, removed at exit): set KSPEC_CACHE_DIR to a writable directory to "
          "keep builds", file=sys.stderr)
    _USABLE[key] = tmp
    return tmp
