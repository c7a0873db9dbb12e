"""Build the demo model's corpus: Python 3.11's documentation and source, as Debian packages them.

    python tools/demo_corpus.py OUT_DIR [--debs DIR]

What it is (about 40 MB of human-written text, all under the PSF License Version 2, the licence of
Python's documentation and source, see ``fp8lab/engine/data/demo/LICENSE-CORPUS``):

- ``python3.11-doc``: the reStructuredText sources of the Python 3.11 documentation (the ``_sources``
  folder of the HTML build: tutorial, library and language reference, HOWTOs, what's new), without
  the generated changelog (bug-tracker numbers, not prose);
- ``libpython3.11-minimal``, ``libpython3.11-stdlib``, ``idle-python3.11``: the standard library's
  Python source; ``libpython3.11-testsuite``: its test suite (real code with comments and docstrings);
  generated files are left out (the codec tables under ``encodings/`` and ``pydoc_data/topics.py``,
  a copy of the documentation).

Each file is one *document*. A document is held out for evaluation when the first 8 hex digits of the
SHA-256 of its name (``package:path``) are below ``HELD_OUT_PERMILLE`` / 1000 of the range, so the split
depends on names only, not on the order files are found in. ``OUT_DIR`` receives ``train.txt`` and
``heldout.txt`` (documents joined by ``DOC_SEPARATOR``) and ``manifest.json`` (package versions, SHA-256
of each .deb and of both splits, document and byte counts), so a rebuild can be checked byte for byte.

The packages come from Debian's archive through ``apt-get download`` (``--debs DIR`` reuses .deb files
already there). Debian replaces a package version when it publishes a security update; the manifest
says which version a corpus was built from (``bench/RESULTS.md`` records the one the shipped model used).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGES = ("python3.11-doc", "libpython3.11-minimal", "libpython3.11-stdlib", "idle-python3.11",
            "libpython3.11-testsuite")
DOC_SOURCES = "usr/share/doc/python3.11/html/_sources/"
HELD_OUT_PERMILLE = 20
"""2% of the documents (by name hash) are held out."""
DOC_SEPARATOR = "\n<|endoftext|>\n"
"""Between documents in ``train.txt`` and ``heldout.txt``; the tokenizer turns it into its special token."""
EXCLUDED = ("whatsnew/changelog.rst.txt", "/encodings/", "pydoc_data/topics.py")


def is_document(path: str) -> bool:
    """Whether a path inside a package is a corpus document (see the module docstring)."""
    if any(part in path for part in EXCLUDED):
        return False
    if path.startswith(DOC_SOURCES):
        return path.endswith(".rst.txt")
    return path.startswith("usr/lib/python3.11/") and path.endswith(".py")


def is_held_out(name: str) -> bool:
    """The split rule: a stable function of the document's name."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) < HELD_OUT_PERMILLE * (1 << 32) // 1000


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_debs(folder: Path) -> dict[str, Path]:
    """``apt-get download`` each package into ``folder`` unless a .deb of it is already there."""
    debs = {}
    for package in PACKAGES:
        found = sorted(folder.glob(f"{package}_*.deb"))
        if not found:
            subprocess.run(["apt-get", "download", package], cwd=folder, check=True)
            found = sorted(folder.glob(f"{package}_*.deb"))
        if len(found) != 1:
            raise SystemExit(f"demo_corpus: expected one {package}_*.deb in {folder}, found {len(found)}")
        debs[package] = found[0]
    return debs


def deb_documents(deb: Path) -> list[tuple[str, str]]:
    """``(path, text)`` of every corpus document in a .deb (UTF-8 files only), sorted by path."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.tar"
        with open(data, "wb") as f:
            subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=f, check=True)
        docs = []
        with tarfile.open(data) as tar:
            for member in tar:
                path = member.name.removeprefix("./")
                if not member.isfile() or not is_document(path):
                    continue
                raw = tar.extractfile(member).read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    continue  # a few test files are deliberately not UTF-8: not text to learn from
                docs.append((path, text.replace("\r\n", "\n").strip() + "\n"))
    return sorted(docs)


def deb_version(deb: Path) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def build(out: Path, debs_dir: Path) -> dict:
    """Write ``train.txt``, ``heldout.txt`` and ``manifest.json`` into ``out``; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    debs_dir.mkdir(parents=True, exist_ok=True)
    debs = download_debs(debs_dir)
    splits = {"train": [], "heldout": []}
    manifest = {"packages": {}, "held_out_permille": HELD_OUT_PERMILLE, "splits": {}}
    for package, deb in debs.items():
        docs = deb_documents(deb)
        manifest["packages"][package] = {"version": deb_version(deb), "deb_sha256": sha256_file(deb),
                                         "documents": len(docs)}
        for path, text in docs:
            name = f"{package}:{path}"
            splits["heldout" if is_held_out(name) else "train"].append((name, text))
    for split, docs in splits.items():
        target = out / f"{split}.txt"
        target.write_text(DOC_SEPARATOR.join(text for _, text in docs), encoding="utf-8")
        manifest["splits"][split] = {"documents": len(docs), "bytes": target.stat().st_size,
                                     "sha256": sha256_file(target), "names": [name for name, _ in docs]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for train.txt, heldout.txt and manifest.json")
    parser.add_argument("--debs", type=Path, default=None, help="folder of .deb files (default: OUT/debs)")
    args = parser.parse_args(argv)
    manifest = build(args.out, args.debs or args.out / "debs")
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['documents']} documents, {info['bytes'] / 1e6:.1f} MB, sha256 {info['sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
