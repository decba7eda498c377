"""Watching small files and directories of them (rule sets, routing documents, endpoint
lists) for changes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from pathlib import Path

log = logging.getLogger(__name__)


async def watch_file(path: Path, interval_s: float) -> AsyncGenerator[str, None]:
    """The file's text now and after every change, polled every ``interval_s``.

    Polling (rather than inotify) also sees files replaced by rename, on any filesystem;
    the content is compared, since coarse mtimes miss quick successive writes. The files
    are small, so reading them blocks the loop for microseconds. A missing file is
    reported once and waited for.
    """
    last: str | None = None
    missing_logged = False
    while True:
        try:
            text = _read(path)
        except (OSError, UnicodeDecodeError) as err:
            if not missing_logged:
                log.warning("cannot read %s: %s", path, err)
                missing_logged = True
        else:
            missing_logged = False
            if text != last:
                last = text
                yield text
        await asyncio.sleep(interval_s)  # the polling period


async def watch_directory(
    directory: Path, suffix: str, interval_s: float
) -> AsyncGenerator[dict[str, str], None]:
    """{file stem: text} of the directory's ``*suffix`` files now and after every change
    (polled like watch_file). Files that cannot be read are left out and logged once."""
    last: dict[str, str] | None = None
    unreadable: set[Path] = set()
    while True:
        texts = _read_directory(directory, suffix, unreadable)
        if texts != last:
            last = texts
            yield texts
        await asyncio.sleep(interval_s)  # the polling period


def _read_directory(directory: Path, suffix: str, unreadable: set[Path]) -> dict[str, str]:
    texts = {}
    for path in sorted(directory.glob(f"*{suffix}")):
        try:
            texts[path.stem] = _read(path)
        except (OSError, UnicodeDecodeError) as err:
            if path not in unreadable:
                log.warning("cannot read %s: %s", path, err)
                unreadable.add(path)
        else:
            unreadable.discard(path)
    return texts


def _read(path: Path) -> str:
    return path.read_text("utf-8")
