"""The client's own remote-tpu as a wheel, for ``remote-tpu setup`` to install on
every host: the very modules this client imports (a checkout, an edit, an
unpublished version alike), so that every host runs what the client runs.

A wheel is a zip file of the package's files and a ``.dist-info`` directory
(PEP 427); the one made here is reproducible (sorted entries, fixed times), so
the digest of its modules says whether a host already has it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import zipfile
from collections.abc import Mapping

from ._core.exceptions import ConfigurationError

DISTRIBUTION = "remote-tpu"
_PACKAGES = ("remote_tpu", "remote_tpu_agent")
_PURE_WHEEL = ("Wheel-Version: 1.0\nGenerator: remote-tpu\nRoot-Is-Purelib: true\n"
               "Tag: py3-none-any\n")
_EPOCH = (1980, 1, 1, 0, 0, 0)


def write_wheel(directory: str, name: str, version: str, tag: str,
                files: Mapping[str, str], dist_info: Mapping[str, bytes],
                compress: bool = True) -> str:
    """A wheel in ``directory`` holding ``files`` (its path in the wheel ->
    the file to copy) and ``dist_info`` (a file name -> its bytes; METADATA
    and WHEEL at least); RECORD is written here. Returns its path."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    info = f"{stem}.dist-info"
    path = os.path.join(directory, f"{stem}-{tag}.whl")
    record = []
    with zipfile.ZipFile(path, "w", method, compresslevel=1) as z:
        entries = [(arc, None, source) for arc, source in files.items()]
        entries += [(f"{info}/{n}", data, None) for n, data in dist_info.items()]
        for arc, data, source in sorted(entries, key=lambda e: e[0]):
            if data is None:
                with open(source, "rb") as f:
                    data = f.read()
            entry = zipfile.ZipInfo(arc, _EPOCH)
            entry.external_attr = 0o644 << 16
            entry.compress_type = method
            z.writestr(entry, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arc},sha256={digest.decode()},{len(data)}")
        entry = zipfile.ZipInfo(f"{info}/RECORD", _EPOCH)
        entry.external_attr = 0o644 << 16
        z.writestr(entry, "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path


_JUNK = (".pyc", ".pyo", "~", ".swp", ".orig", ".rej", ".bak")


def client_wheel(directory: str) -> tuple[str, str]:
    """(path, digest) of a wheel, in ``directory``, of the remote-tpu this
    client imports; the digest is of its modules' names and contents alone
    (not of the zip's bytes or the metadata), so equal code is equal anywhere."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigurationError(
            "remote-tpu setup copies this client's own remote-tpu to the hosts, but it is "
            "not installed as a distribution here (no remote_tpu-*.dist-info): install it "
            "with `pip install -e .` from the checkout (or `pip install remote-tpu`)") from None
    files = {}
    for package in _PACKAGES:
        module = __import__(package)
        root = os.path.dirname(os.path.abspath(module.__file__))
        for here, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for n in names:
                if n.endswith(_JUNK) or n.startswith("."):    # editors' and OSes' files
                    continue
                source = os.path.join(here, n)
                files[f"{package}/{os.path.relpath(source, root)}".replace(os.sep, "/")] = source
    dist_info = {"WHEEL": _PURE_WHEEL.encode()}
    # (An egg-info beside a checkout says PKG-INFO: the same headers.)
    metadata = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if not metadata:
        raise ConfigurationError("the installed remote-tpu has no metadata (METADATA or PKG-INFO): "
                                 "reinstall it (`pip install -e .` from the checkout)")
    dist_info["METADATA"] = metadata.encode()
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        dist_info["entry_points.txt"] = entry_points.encode()
    path = write_wheel(directory, DISTRIBUTION, dist.version, "py3-none-any", files, dist_info)
    digest = hashlib.sha256()
    for arc in sorted(files):
        with open(files[arc], "rb") as f:
            digest.update(f"{arc}\0".encode() + hashlib.sha256(f.read()).digest())
    return path, digest.hexdigest()
