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
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

from kspec.core import KspecError

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


def discard(d: Path) -> None:
    """Move an entry aside atomically, then delete it (a concurrent reader sees all or nothing)."""
    trash = d.with_name(f".discard-{d.name[:16]}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, trash)
    except FileNotFoundError:
        return                  # another process removed it first
    except OSError as e:
        raise KspecError(f"cannot remove the damaged cache entry {d}: {e.strerror}",
                         hint="check the permissions of the cache directory, or clear it with `kspec cache clear`") \
            from None
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
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
