"""A Hugging Face cache directory laid out as huggingface_hub lays it out, built from local files:

    <cache>/models--<org>--<name>/blobs/<sha256 of the file>
    <cache>/models--<org>--<name>/snapshots/<commit>/<path>  -> ../../blobs/<sha256>  (relative symlinks)
    <cache>/models--<org>--<name>/refs/<branch or tag>        (the commit hash)

so tests resolve Hub ids offline (``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE=<cache>``).
"""
from __future__ import annotations

import hashlib
import os
import shutil


def add_snapshot(cache_dir: str, repo_id: str, src_dir: str, refs: tuple[str, ...] = ("main",),
                 commit: str | None = None, skip: tuple[str, ...] = ()) -> str:
    """Copy every file under ``src_dir`` (except names in ``skip``) into the cache as one commit of
    ``repo_id`` that each of ``refs`` points at; returns the snapshot directory."""
    org, name = repo_id.split("/")
    repo = os.path.join(cache_dir, f"models--{org}--{name}")
    files = []
    for root, _, names in os.walk(src_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), src_dir)
            if rel not in skip:
                files.append(rel)
    if commit is None:
        h = hashlib.sha1(repo_id.encode())
        for rel in sorted(files):
            h.update(rel.encode())
            with open(os.path.join(src_dir, rel), "rb") as fh:
                h.update(fh.read())
        commit = h.hexdigest()
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for rel in files:
        src = os.path.join(src_dir, rel)
        with open(src, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
        blob = os.path.join(repo, "blobs", digest)
        if not os.path.exists(blob):
            shutil.copyfile(src, blob)
        dst = os.path.join(snap, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as fh:
            fh.write(commit)
    return snap
