"""working_dir=: a project directory, on every host, by content.

The tree's files (minus what its ``.gitignore`` files and a
``.remote_tpu_ignore`` leave out, and ``.git``) are described file by file,
and their bytes travel as buffers of the agents' argument cache: the files
under 1 MiB packed together in one buffer, each larger file in its own. The
gateway is asked which it holds and only the others are sent, so a second call
with an unchanged tree sends nothing; this process remembers each file's
digest by its size, mtime and inode, so it reads nothing either.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
import warnings

import pathspec

from ._core import digests
from ._core.exceptions import ConfigurationError
from ._core.proto import remote_tpu_pb2 as pb

LIMIT_BYTES = 512 << 20      # the whole tree; data belongs in a bucket
PACKED_BELOW = 1 << 20
PACK_BYTES = 64 << 20        # small files go in packs of about this much
IGNORE_FILES = (".gitignore", ".remote_tpu_ignore")
_digests: dict[tuple, bytes] = {}     # a file's or a pack's stat signature: its digest


@dataclasses.dataclass(frozen=True)
class _File:
    rel: str                  # '/'-separated, relative to the root
    path: str
    size: int
    executable: bool
    signature: tuple          # what changes when its content may have

    @classmethod
    def of(cls, rel: str, path: str, st: os.stat_result) -> _File:
        return cls(rel, path, st.st_size, bool(st.st_mode & 0o100),
                   (path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns))


def _human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


class _Ignores:
    """The ignore files met so far, each applying below its own directory;
    as in git, the deepest file that has a say decides."""

    def __init__(self) -> None:
        self._specs: list[tuple[str, pathspec.PathSpec]] = []
        self._negations = False        # a '!' pattern anywhere: no directory is skipped whole

    def load(self, root: str, rel_dir: str) -> None:
        for name in IGNORE_FILES:
            path = os.path.join(root, rel_dir, name)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
                spec = pathspec.GitIgnoreSpec.from_lines(lines)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue
            except OSError as exc:
                raise ConfigurationError(f"working_dir: cannot read {path}: {exc}") from None
            self._specs.append((rel_dir, spec))
            self._negations |= any(line.lstrip().startswith("!") for line in lines)

    def _says(self, path: str) -> bool:
        verdict = None
        for base, spec in self._specs:
            if base and not path.startswith(base + "/"):
                continue
            include = spec.check_file(path[len(base) + 1:] if base else path).include
            if include is not None:
                verdict = include
        return bool(verdict)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether to leave out a file; a directory is skipped whole only when
        it is ignored and so is anything in it (with no '!' pattern that could
        take a file back): else its files are asked one by one."""
        if not is_dir:
            return self._says(rel)
        return not self._negations and self._says(rel + "/") and \
            self._says(rel + "/\0probe")


def scan(root: str, ignore: bool = True) -> list[_File]:
    """The files of the tree at ``root`` that travel, sorted by path (with
    ``ignore``, without what its ignore files leave out)."""
    ignores = _Ignores()
    files = []
    walked: dict[str, tuple[int, int]] = {}     # each directory walked: what it is
    for directory, dirnames, filenames in os.walk(root, onerror=_unreadable,
                                                  followlinks=True):
        rel_dir = os.path.relpath(directory, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        if _loops(root, rel_dir, walked):
            dirnames[:] = []
            continue
        if ignore:
            ignores.load(root, rel_dir)
        join = (lambda n: f"{rel_dir}/{n}") if rel_dir else (lambda n: n)
        dirnames[:] = sorted(d for d in dirnames
                             if d != ".git" and not ignores.ignored(join(d), True))
        for name in filenames:
            rel = join(name)
            if ignores.ignored(rel, False):
                continue
            path = os.path.join(directory, name)
            _check_name(root, rel)
            try:
                st = os.stat(path)            # a link travels as what it points to
            except OSError:
                continue                      # a dangling link
            if stat.S_ISREG(st.st_mode):
                files.append(_File.of(rel, path, st))
    files.sort(key=lambda f: f.rel)
    return files


def _loops(root: str, rel_dir: str, walked: dict[str, tuple[int, int]]) -> bool:
    """Whether the directory ``rel_dir`` is one of the directories above it
    (reached through a link: followed, it would never end), said as a
    warning; else it is remembered in ``walked``. Other links to a directory
    are followed: their files travel under each path."""
    st = os.stat(os.path.join(root, rel_dir))
    key = (st.st_dev, st.st_ino)
    parts = rel_dir.split("/") if rel_dir else []
    for i in range(len(parts)):
        above = "/".join(parts[:i])
        if walked.get(above) == key:
            warnings.warn(
                f"remote_tpu: {os.path.join(root, rel_dir)} leads back to "
                f"{os.path.join(root, above) if above else root}, a directory that holds "
                "it: not followed (a loop), so its files travel once, from there. Remove "
                "the link (or, in a working_dir, list it in .remote_tpu_ignore) to silence "
                "this",
                stacklevel=4)
            return True
    walked[rel_dir] = key
    return False


def _check_name(root: str, rel: str) -> None:
    """A name every host can write as it is: UTF-8, and no backslash."""
    try:
        rel.encode("utf-8")
        if "\\" not in rel:
            return
    except UnicodeEncodeError:
        pass
    raise ConfigurationError(
        f"{os.path.join(root, rel)!r}: a file name that is not UTF-8 or holds a backslash "
        "cannot travel to the hosts; rename it, or leave it out with .remote_tpu_ignore")


def _unreadable(exc: OSError) -> None:
    raise ConfigurationError(f"working_dir: cannot read {exc.filename}: {exc.strerror}")


def _check_size(root: str, files: list[_File], limit: int) -> None:
    total = sum(f.size for f in files)
    if total <= limit:
        return
    largest = sorted(files, key=lambda f: -f.size)[:8]
    listing = "\n".join(f"  {_human(f.size):>10}  {f.rel}" for f in largest)
    raise ConfigurationError(
        f"working_dir {root} holds {_human(total)} in {len(files)} files, over its "
        f"{_human(limit)} limit. Its largest files:\n{listing}\nLeave them out with "
        f"{os.path.join(root, '.remote_tpu_ignore')} (.gitignore syntax), or keep data in "
        "a bucket and read it on the hosts.")


def _read(f: _File) -> bytes:
    try:
        with open(f.path, "rb") as src:
            data = src.read()
    except OSError as exc:
        raise ConfigurationError(f"cannot read {f.path}: {exc.strerror}; make it readable, "
                                 "or leave it out with .remote_tpu_ignore") from None
    if len(data) != f.size:
        raise ConfigurationError(f"working_dir: {f.path} changed while it was being sent; "
                                 "call again")
    return data


class _Buffer:
    """One buffer of the tree: ``data()`` reads it (when the gateway lacks it)."""

    def __init__(self, files: list[_File], packed: bool) -> None:
        self.files, self.packed = files, packed
        key = tuple(f.signature for f in files)
        self.digest = _digests.get(key)
        self._data: bytes | memoryview | None = None
        if self.digest is None:
            self.digest = digests.of(self.data())
            if len(_digests) > 100_000:
                _digests.clear()
            _digests[key] = self.digest
        self.size = sum(f.size for f in files)

    def data(self) -> bytes | memoryview:
        if self._data is None:
            if self.packed:
                self._data = b"".join(_read(f) for f in self.files)
            else:
                try:
                    with open(self.files[0].path, "rb") as src:
                        self._data = memoryview(mmap.mmap(src.fileno(), 0,
                                                          access=mmap.ACCESS_READ))
                except OSError as exc:
                    raise ConfigurationError(
                        f"cannot read {self.files[0].path}: {exc.strerror}; make it "
                        "readable, or leave it out with .remote_tpu_ignore") from None
            if self.digest is not None and digests.of(self._data) != self.digest:
                raise ConfigurationError(
                    f"working_dir: {', '.join(f.rel for f in self.files[:3])} changed while "
                    "being sent (a file changed and its size, mtime and inode did not); "
                    "call again")
        return self._data


def _packs(small: list[_File]) -> list[list[_File]]:
    """The small files with bytes, in packs of about PACK_BYTES (a change
    sends its own pack again, not every small file)."""
    packs: list[list[_File]] = [[]]
    size = 0
    for f in small:
        if not f.size:
            continue
        if size + f.size > PACK_BYTES and packs[-1]:
            packs.append([])
            size = 0
        packs[-1].append(f)
        size += f.size
    return [p for p in packs if p]


def describe(root: str, limit: int | None = LIMIT_BYTES, files: list[_File] | None = None
             ) -> tuple[pb.WorkingDir, list[_Buffer]]:
    """The tree at ``root`` (its ``files``: by default those ``scan`` finds)
    as a job spec carries it, and its buffers."""
    files = scan(root) if files is None else files
    if limit is not None:
        _check_size(root, files, limit)
    buffers = [_Buffer(pack, True) for pack in _packs([f for f in files
                                                       if f.size < PACKED_BELOW])]
    buffers += [_Buffer([f], False) for f in files if f.size >= PACKED_BELOW]
    tree = pb.WorkingDir(blobs=[pb.BlobRef(digest=b.digest, size=b.size) for b in buffers])
    where = {}
    for index, buffer in enumerate(buffers):
        offset = 0
        for f in buffer.files:
            where[f.rel] = (index, offset)
            offset += f.size
    for f in files:
        index, offset = where.get(f.rel, (0, 0))
        tree.files.add(path=f.rel, size=f.size, executable=f.executable, blob=index,
                       offset=offset)
    tree.digest = digests.of(tree.SerializeToString(deterministic=True))
    return tree, buffers
