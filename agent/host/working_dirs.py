"""working_dir=: the caller's project tree, placed on this host for its jobs.

The tree's files arrive as buffers of the argument cache (``host.blobs``): small
files packed in one, large ones alone. Each tree is written out once, in a
directory named by its digest, and reused by the next job with the same tree;
before each use, whatever an earlier job changed there (a file written,
removed or added) is put back as the tree has it, so every job starts from the
caller's files and nothing else (but Python's ``__pycache__``, which only
speeds up importing the tree's own modules). The ``KEEP`` trees used last stay; older ones
are removed (one job runs at a time on a host, and its tree is the newest).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading

from remote_tpu._core.dirs import prune_oldest
from remote_tpu._core.local_names import RULE, local_path, problem
from remote_tpu._core.proto import remote_tpu_pb2 as pb

from remote_tpu_agent.jobs.attempts import run_key

KEEP = 4


def refs_of(spec: pb.JobSpec) -> list[pb.BlobRef]:
    """Every buffer a job needs on each host: its arguments', then its working
    dir's, then each local remote_tpu.Data tree's."""
    return [*spec.blobs, *spec.working_dir.blobs, *(b for t in spec.data for b in t.blobs)]


def place_job(dirs: WorkingDirs, spec: pb.JobSpec, paths: list[str]
              ) -> tuple[list[str], str, dict[str, str]]:
    """A job's trees on this host, from the cache files of ``refs_of(spec)``:
    (the call's own buffers' files, its working dir's copy or "", each Data
    tree's copy by digest). Raises OSError and ValueError."""
    n = len(spec.blobs)
    call, rest = paths[:n], paths[n:]
    k = len(spec.working_dir.blobs)
    working_dir = dirs.place(spec.working_dir, rest[:k], evict=False, job=run_key(spec))
    rest = rest[k:]
    data = {}
    for tree in spec.data:
        data[tree.digest.hex()] = dirs.place(tree, rest[:len(tree.blobs)], evict=False,
                                             job=run_key(spec))
        rest = rest[len(tree.blobs):]
    placed = {os.path.basename(p) for p in [working_dir, *data.values()] if p}
    if placed:
        dirs.evict(placed)
    return call, working_dir, data


class WorkingDirs:
    """The trees of one host's jobs, under ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.RLock()
        self._restored: dict[str, str] = {}    # a tree: the job it was last made ready for

    def place(self, tree: pb.WorkingDir, paths: list[str], evict: bool = True,
              job: str = "") -> str:
        """The directory holding ``tree`` exactly (its buffers' cache files are
        ``paths``); "" for a job without one. Within one ``job`` (its several
        processes on this host), restored once only: a process already running
        keeps what it wrote. Raises OSError (a full disk) and ValueError (a
        tree that names a path outside itself)."""
        if not tree.digest:
            return ""
        bad = [f.path for f in tree.files
               if problem(f.path) or (f.size and f.blob >= len(paths))]
        if bad:
            raise ValueError(f"the working_dir names files outside itself, or buffers it "
                             f"lacks: {bad[:3]} (each name must be {RULE})")
        name = tree.digest.hex()
        target = os.path.join(self.root, name)
        with self._lock:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            changed = True
            if os.path.isdir(target):
                if job and self._restored.get(name) == job:
                    return target
                changed = _restore(tree, paths, target, self._written(name))
            else:
                building = tempfile.mkdtemp(dir=self.root, prefix=".building-")
                try:
                    _write_all(tree, paths, building)
                    os.rename(building, target)
                except BaseException:
                    shutil.rmtree(building, ignore_errors=True)
                    raise
            if changed:
                self._remember(name, target, tree)
            os.utime(target)                       # its last use, for evict
            self._restored[name] = job
            if evict:
                self.evict({name})
        return target

    # What each file looked like when written (size, mtime, ctime, mode): any
    # change a job made shows (a rewrite that kept size and mtime changes ctime).
    def _written(self, name: str) -> dict[str, list[int]]:
        try:
            with open(os.path.join(self.root, name + ".json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _remember(self, name: str, target: str, tree: pb.WorkingDir) -> None:
        seen = {}
        for f in tree.files:
            st = os.stat(os.path.join(target, f.path))
            seen[f.path] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode]
        with open(os.path.join(self.root, name + ".json"), "w") as out:
            json.dump(seen, out)

    def evict(self, keep: set[str]) -> None:
        """Remove the trees used longest ago beyond KEEP (never those of ``keep``)."""
        with self._lock:
            self._evict(keep)

    def _evict(self, keep: set[str]) -> None:
        for entry in os.scandir(self.root):
            if entry.name.startswith(".building-"):      # a build an agent died during
                shutil.rmtree(entry.path, ignore_errors=True)

        def remove(path: str) -> None:
            _remove(path)
            try:
                os.unlink(path + ".json")
            except OSError:
                pass
        prune_oldest(self.root, max(KEEP, len(keep)),
                     {os.path.join(self.root, name) for name in keep}, remove)


def _remove(path: str) -> None:
    """Remove a tree (or part of one) even where a job made it read-only."""
    def writable(_, name, __):
        try:
            os.chmod(os.path.dirname(name), 0o755)
            if os.path.isdir(name) and not os.path.islink(name):
                os.chmod(name, 0o755)
                shutil.rmtree(name, ignore_errors=True)
            else:
                os.unlink(name)
        except OSError:
            pass
    shutil.rmtree(path, onerror=writable)


def _write_file(f: pb.WorkFile, paths: list[str], directory: str, fresh: bool = False) -> None:
    """Write one file of the tree (in a directory being built, ``fresh``: at
    once; else by a temporary file put in its place)."""
    path = local_path(directory, f.path)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.lexists(path) and (os.path.isdir(path) and not os.path.islink(path)):
        _remove(path)
    tmp = path if fresh else f"{path}.{os.getpid()}.remote_tpu-writing"
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        _remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755 if f.executable else 0o644)
    try:
        if f.size:
            with open(paths[f.blob], "rb") as src:
                offset, left = f.offset, f.size
                while left:                       # in the kernel
                    sent = os.sendfile(fd, src.fileno(), offset, left)
                    if sent == 0:
                        raise ValueError(f"the cached bytes of {f.path} end early")
                    offset += sent
                    left -= sent
    finally:
        os.close(fd)
    os.chmod(tmp, 0o755 if f.executable else 0o644)
    if tmp != path:
        os.replace(tmp, path)


def _write_all(tree: pb.WorkingDir, paths: list[str], directory: str) -> None:
    os.chmod(directory, 0o755)
    for f in tree.files:
        _write_file(f, paths, directory, fresh=True)


def _restore(tree: pb.WorkingDir, paths: list[str], target: str,
             written: dict[str, list[int]]) -> bool:
    """Put back what an earlier job changed in ``target``: files rewritten,
    removed or added (and directories it made), so it holds the tree alone.
    Whether any file had to be written again."""
    wanted = {f.path: f for f in tree.files}
    parents = {os.path.dirname(p) for p in wanted}
    parents |= {"/".join(p.split("/")[:i]) for p in parents for i in range(len(p.split("/")))}
    for directory, _, _ in os.walk(target):           # a job may have made some read-only
        try:
            os.chmod(directory, 0o755)
        except OSError:
            pass
    for directory, dirnames, filenames in os.walk(target, topdown=False):
        rel_dir = os.path.relpath(directory, target).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        if "__pycache__" in rel_dir.split("/"):      # Python's own cache of the tree's
            _unlink_links(directory, filenames + dirnames)     # modules: kept, but links
            continue
        for name in filenames + [d for d in dirnames
                                 if os.path.islink(os.path.join(directory, d))]:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(directory, name)
            st = os.lstat(full)
            f = wanted.get(rel)
            if f is None or not stat.S_ISREG(st.st_mode) or \
                    [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode] != \
                    written.get(rel):
                os.unlink(full)
        if rel_dir and rel_dir not in parents:
            try:
                os.rmdir(directory)              # a directory a job made, now empty
            except OSError:
                pass
    changed = False
    for f in tree.files:
        path = os.path.join(target, f.path)
        if not os.path.isfile(path) or os.path.islink(path):
            _write_file(f, paths, target)
            changed = True
    return changed


def _unlink_links(directory: str, names: list[str]) -> None:
    """Remove the symbolic links among ``names`` in ``directory``: a job's,
    which could take a file of the tree elsewhere."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            os.unlink(path)
